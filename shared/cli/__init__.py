"""The `tandem` command line: launch an embedded stack, generate, show status."""
