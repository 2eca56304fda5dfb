"""The C extension (heterospec/_C), imported in one place, with a message that says what to do when it is not
built here: Python run from a clone's root imports the source tree, whose _C was never compiled."""
import os

try:
    from . import _C  # noqa: F401
except ImportError as e:
    _here = os.path.dirname(os.path.abspath(__file__))
    if any(f.startswith("_C.") for f in os.listdir(_here)):
        raise                                   # built, but it cannot load here: its own error says why
    raise ImportError(
        f"heterospec: the C extension is not built in {_here} (this is a source tree, imported because Python "
        "runs from the clone's root): run from another directory to use the installed heterospec, or build it "
        "here with `pip install -e .`") from e
