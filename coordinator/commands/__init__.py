"""The `shoal` subcommands, one module each: its arguments (`setup_arg_parser`) and what it
does with them (`main`). coordinator/cli.py only gathers them and dispatches."""
