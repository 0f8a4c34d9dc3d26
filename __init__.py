# SPDX-License-Identifier: Apache-2.0
"""Not the package: the top folder of a checkout of bridge (the package is its bridge/).

Python imports this file when a checkout folder named ``bridge`` lies in the
working directory (or anywhere on ``sys.path``) ahead of the package. Without
it the folder would import as an empty namespace package, and the first use
would fail with ``module 'bridge' has no attribute 'unify'``. Here the package
is looked for past this folder (an installed bridge, or this checkout's own
``bridge/``), and loaded in its place; where there is none, the import fails
in words that say what happened.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _load_the_package_instead() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    outside = os.path.dirname(here)  # the entry of sys.path that found this folder
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != outside]
    spec = importlib.machinery.PathFinder.find_spec(__name__, path)
    if spec is None or spec.origin is None or not spec.loader:  # none, or a namespace
        raise ImportError(
            f"'import bridge' found {here}, the top folder of a checkout of bridge, not "
            "the package (which is its bridge/ subfolder), and no installed bridge. Install "
            f"it (pip install -e {here}) and run from another directory, or run inside the "
            "checkout.",
            name=__name__,
            path=__file__,
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[__name__] = module  # what `import bridge` gives: the package
    spec.loader.exec_module(module)


if __name__ == "bridge":  # imported as the package; under another name (a test runner
    _load_the_package_instead()  # collecting the checkout, say) it is an empty module
