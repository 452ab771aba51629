"""The process the code runs in: how many CPU threads it uses (`threads`), what it knows of its parent, the launcher
(`parent`), how it reads typed settings from layers of YAML and `key=value` (`config_layers`), and the
locks that one live process holds, naming their holder (`held_lock`)."""
