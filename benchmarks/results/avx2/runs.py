# The decoder C calls per cycle, by row count: CODED=1 python runs.py ar hs 1,2,3 (CODED=0: float32 packing).
# The cycle-budget session's script (../cycle-budget/runs.py), with pack_rows' default set from CODED first.
import os
import runpy

from heterospec.models import cpu_gemm

cpu_gemm.pack_rows.__defaults__ = (os.environ.get("CODED") == "1",)
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cycle-budget", "runs.py"),
               run_name="__main__")
