"""The process the code runs in: how many CPU threads it uses (`threads`) and what it knows of its parent, the
launcher (`parent`)."""
