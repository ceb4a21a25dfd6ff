"""The ``kerasdist`` command: ``plugins``, ``env`` (and ``launch``)."""

import argparse
import contextlib
import json
import os
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
        backends = ",".join(r["backends"]) or ("any" if r["kind"] else "")
        print(f"{r['name']:<{width}}  {str(r['kind'] or '?'):<12}  {state:<11}  {backends:<18}  {package}")
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
    if row["options"] is not None:
        options = ", ".join(f"{k}={v}" for k, v in row["options"].items()) or "(none)"
        print(f"{pad}options: {options}")


def _env(args):
    import kerasdist
    from kerasdist.manager import get_system

    system = get_system()
    cluster = system.detect_cluster()
    auto = system.hook.kerasdist_auto_strategy(cluster=cluster)
    listeners = [item for found in system.hook.kerasdist_listeners(cluster=cluster) if found for item in found]
    backend = _backend()
    info = {"cluster": cluster.as_dict(), "is_chief": cluster.is_chief, "num_workers": cluster.num_workers,
            "auto_strategy": auto, "keras_backend": backend, "local_devices": _devices(backend),
            "listens": listeners, "kerasdist": kerasdist.__version__}
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        for key, value in info.items():
            if key == "listens":
                print("listens:" + ("" if value else " nothing (a single process opens no port)"))
                for item in value:
                    print(f"  {item['address']}  ({item['interfaces']} interfaces)  {item['what']}")
                if value:
                    print("  see docs/security.md: TensorFlow's servers accept any client that reaches them")
            else:
                print(f"{key}: {value}")
    return 0


def _backend():
    from .backend import keras_backend

    return keras_backend()


def _devices(backend):
    """This process's devices as ``backend``'s framework names them; if it is missing, why and how to install it."""
    from .registry import backend_missing

    missing = backend_missing(backend)
    if missing:
        return f"unknown: {missing}"
    with _native_stderr_silenced():  # TensorFlow's and XLA's C++ start-up notices ignore the log-level settings
        if backend == "jax":
            import jax

            return [f"{d.platform}:{d.id}" for d in jax.local_devices()]
        if backend == "tensorflow":
            import tensorflow as tf

            return [d.name for d in tf.config.list_logical_devices()]
    return f"unknown: `kerasdist env` lists the devices of the tensorflow and jax backends, not of {backend!r}"


@contextlib.contextmanager
def _native_stderr_silenced():
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _launch(args):
    from .launch import launch

    return launch(args)


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
                       description="kerasdist launch -n N [--] script.py [args]",
                       epilog="Security: the workers' TensorFlow gRPC servers listen on EVERY interface (TensorFlow "
                              "cannot bind one address) and accept any client, which can run code as you. Keep their "
                              "ports behind a firewall; `kerasdist env` in a worker lists what listens, and "
                              "docs/security.md has a firewall recipe.")
    from .launch import add_arguments

    add_arguments(p)
    p.set_defaults(func=_launch)
    return parser


def main(argv=None):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's Python-side warnings, if it loads
    from .errors import KerasdistError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KerasdistError as exc:  # bad input: the message, not a traceback
        message = str(exc)
        prefix = f"kerasdist {args.command}: "
        print(f"{prefix}error: {message[len(prefix):] if message.startswith(prefix) else message}",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
