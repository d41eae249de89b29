"""The `ringcoll` command (also `python -m ringcoll`): one subcommand per tool.

    mpiexec -n 4 ringcoll tune -o tuning.json    # measure auto's tuning table: ringcoll.tune
    ringcoll explain allreduce -p 4 -n 8         # one collective, step by step: ringcoll.explain
"""

import sys

COMMANDS = {
    "tune": "measure the all-reduce algorithms here and write auto's tuning table",
    "explain": "run one collective on small numbers and show its schedule step by step",
}
USAGE = "usage: ringcoll COMMAND [ARGS]   (ringcoll COMMAND -h for its options)\n" + "".join(
    f"  {name:<8} {what}\n" for name, what in COMMANDS.items())


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"ringcoll: unknown command {command!r}\n{USAGE}", end="", file=sys.stderr)
        return 2
    if command == "explain":  # thread ranks: no MPI needed
        from .explain import main as explain

        return explain(rest)
    from .tune import main as tune  # imports mpi4py: only when a command needs MPI

    return tune(rest)


if __name__ == "__main__":
    sys.exit(main())
