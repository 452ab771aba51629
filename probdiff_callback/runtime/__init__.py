"""The process the code runs in: how many CPU threads it uses (`threads`) and the named places where a test makes it
fail as a real fault would (`faults`)."""
