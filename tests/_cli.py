"""The command line run in the test's own process: ``heterospec ARGS`` without the 8 s of importing torch and
transformers that a ``python -m heterospec`` subprocess spends (the subprocess form stays where the process
itself is under test: exit status, no traceback, the console script)."""
import sys


def run_cli(argv, capsys):
    """``heterospec *argv`` in this process -> (exit status, stdout, stderr), as a ``python -m heterospec``
    subprocess would give them (a SystemExit becomes its status); any other exception propagates (a traceback
    is a failure)."""
    from heterospec.tools import cli

    capsys.readouterr()
    try:
        rc = cli.main([str(a) for a in argv]) or 0
    except SystemExit as e:
        rc = e.code
        if isinstance(rc, str):        # what the interpreter does with it: the text on stderr, status 1
            print(rc, file=sys.stderr)
            rc = 1
        rc = rc or 0
    out = capsys.readouterr()
    return rc, out.out, out.err
