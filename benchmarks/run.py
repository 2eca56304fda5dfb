"""``python -m benchmarks.run [options]`` from a checkout: the same as ``heterospec bench [options]``
(see heterospec/tools/bench/ and ``heterospec bench --help``)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # a checkout without pip install

from heterospec.tools.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench"] + sys.argv[1:]))
