"""One module per `usaf` subcommand, each exposing `add_command(subparsers)`."""
