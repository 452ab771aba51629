"""The process the code runs in: how many CPU threads it uses (`threads`), the named places where a test makes it
fail as a real fault would (`faults`), and how it reads typed settings from layers of YAML and `key=value`
(`config_layers`)."""
