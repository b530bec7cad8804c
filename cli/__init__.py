"""The stream-run command line (typer). Commands are thin: they parse flags and call streamer."""
