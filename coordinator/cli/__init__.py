"""The `shoal` command (shoal_command.py) and its subcommands, one module each
(`*_command.py`): its arguments (`setup_arg_parser`) and what it does with them (`main`);
options.py holds the options several share, connect.py how they reach the workers."""
