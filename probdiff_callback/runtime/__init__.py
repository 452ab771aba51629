"""The process the code runs in: how many CPU threads it uses (`threads`)."""
