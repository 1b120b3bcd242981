"""The `jaxinfer` subcommands, a module each: `add_parser(sub)` adds its flags, `run(args)` runs it and returns the
exit status. `options` holds the flags and checks they share."""
