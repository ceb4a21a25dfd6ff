"""The ``kerasdist`` command: ``plugins``, ``env`` (and ``launch``)."""

import argparse
import json
import sys


def _plugins(args):
    import kerasdist

    rows = kerasdist.list_plugins()
    if args.kind:
        rows = [r for r in rows if r["kind"] == args.kind]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max([len(r["name"]) for r in rows] + [4])
    for r in rows:
        state = "available" if r["available"] else "unavailable"
        package = f"{r['package']} {r['version'] or ''}".strip() if r["package"] else "(in-process)"
        print(f"{r['name']:<{width}}  {str(r['kind'] or '?'):<12}  {state:<11}  {package}")
        if args.verbose:
            _print_details(r, width)
        if not r["available"]:
            print(f"{'':<{width}}  reason: {r['reason']}")
            if r["install"]:
                print(f"{'':<{width}}  install: {r['install']}")
    return 0


def _print_details(row, width):
    pad = " " * (width + 2)
    if row["description"]:
        print(f"{pad}{row['description']}")
    if row["aliases"]:
        print(f"{pad}aliases: {', '.join(row['aliases'])}")
    if row["backends"]:
        print(f"{pad}backends: {', '.join(row['backends'])}")
    if row["options"] is not None:
        options = ", ".join(f"{k}={v}" for k, v in row["options"].items()) or "(none)"
        print(f"{pad}options: {options}")


def _env(args):
    import kerasdist
    from kerasdist.manager import get_system

    system = get_system()
    cluster = system.detect_cluster()
    auto = system.hook.kerasdist_auto_strategy(cluster=cluster)
    info = {"cluster": cluster.as_dict(), "is_chief": cluster.is_chief, "num_workers": cluster.num_workers,
            "auto_strategy": auto, "keras_backend": _backend(), "local_devices": _devices(),
            "kerasdist": kerasdist.__version__}
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        for key, value in info.items():
            print(f"{key}: {value}")
    return 0


def _backend():
    import keras

    return keras.backend.backend()


def _devices():
    import tensorflow as tf

    return [d.name for d in tf.config.list_logical_devices()]


def _launch(args):
    from .errors import KerasdistError
    from .launch import launch

    try:
        return launch(args)
    except KerasdistError as exc:
        print(f"kerasdist launch: error: {exc}", file=sys.stderr)
        return 2


def build_parser():
    parser = argparse.ArgumentParser(prog="kerasdist", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plugins", help="list strategy, optimization and export plugins")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.add_argument("--kind", choices=("strategy", "optimization", "export"))
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show descriptions, aliases, backends and options with their defaults")
    p.set_defaults(func=_plugins)
    p = sub.add_parser("env", help="print the resolved cluster and what distribute='auto' picks")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_env)
    p = sub.add_parser("launch", help="start N local worker processes that form one cluster (TF_CONFIG on 127.0.0.1)",
                       description="kerasdist launch -n N [--] script.py [args]")
    from .launch import add_arguments

    add_arguments(p)
    p.set_defaults(func=_launch)
    return parser


def main(argv=None):
    import os

    # Quiet TensorFlow's start-up notices if it loads (`env`); "1" is oneDNN's default already.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
