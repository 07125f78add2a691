"""``neorec config``: the reference of config keys (``--keys``: every key, its type, default and
meaning, read from the schema in ``neorec/config/``), or a config as a run would resolve it
(``--config`` and ``--set`` applied and checked), as TOML."""

from __future__ import annotations

import argparse

HELP = "the config keys (--keys), or a config resolved and checked"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``neorec config``."""
    p.add_argument("--keys", action="store_true", help="list every config key")
    p.add_argument(
        "prefix", nargs="?", default="", help="with --keys: only keys starting so (e.g. train.)"
    )
    p.add_argument("--full", action="store_true", help="with --keys: each key's whole docstring")
    p.add_argument("--config", help="TOML config to resolve (default: the built-in one)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")


def run(args: argparse.Namespace) -> int:
    """Print the keys, or the resolved config."""
    from neorec.config import ConfigError

    if args.keys:
        from neorec.config.keys import config_keys, format_keys

        keys = [k for k in config_keys() if k.key.startswith(args.prefix)]
        if not keys:
            raise ConfigError(
                f"no config key starts with {args.prefix!r}; see neorec config --keys"
            )
        print(format_keys(keys, args.full))
        return 0
    if args.prefix or args.full:
        raise ConfigError("a key prefix and --full go with --keys")
    from neorec.config import load_config
    from neorec.train.runs import dump_toml

    print(dump_toml(load_config(args.config, args.set).to_dict()), end="")
    return 0
