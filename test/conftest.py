"""Suite-wide setting: MKL's float32 GEMMs on a fixed code path (as the `ess` command sets it, see ess/cli/__init__.py), so
that comparisons of tokens between two runs of the reference model do not depend on memory alignment."""

import os

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
