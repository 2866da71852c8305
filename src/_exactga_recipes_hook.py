"""Make ``tune run recipes/<name>.py`` run the ``recipes/`` folder of the working directory.

torchtune 0.6.1 installs a top-level ``recipes`` package whose ``__init__`` raises, and
``tune run recipes/x.py`` imports the module ``recipes.x`` with the working directory *last*
on ``sys.path`` (``python -m`` under ``--nproc_per_node`` puts it first, but a regular package
later on the path still beats a plain folder). Either way the installed package wins and the
user's recipe is never run.

This module is imported at interpreter start-up by ``exactga_recipes_path.pth`` and puts one
finder in front of the import system. It answers for exactly one name, ``recipes``, and only
when the working directory has a ``recipes/`` folder; every other import, and every launch from
a directory without one, is untouched. A second finder, :class:`TuneRunPatcher`, quiets the
launcher's traceback after a user error under torchrun. Kept free of heavy imports: it runs in
every interpreter of the environment. See docs/launching.md.
"""

import os
import sys
from importlib.machinery import ModuleSpec, PathFinder

_PACKAGE = "recipes"


class WorkingDirRecipesFinder:
    """Resolve ``import recipes`` to ``./recipes`` when that folder exists."""

    @classmethod
    def find_spec(cls, fullname: str, path=None, target=None) -> ModuleSpec | None:
        if fullname != _PACKAGE:
            return None
        try:
            cwd = os.getcwd()
        except OSError:  # the working directory was deleted
            return None
        if not os.path.isdir(os.path.join(cwd, _PACKAGE)):
            return None
        return PathFinder.find_spec(fullname, [cwd])


class TuneRunPatcher:
    """After ``torchtune._cli.run`` is imported, wrap its torchrun path so that a launch whose
    ranks ended on a user error prints their one message and no launcher traceback
    (``exactga.cli.quiet_user_errors_under_torchrun``; see [user errors] there)."""

    _MODULE = "torchtune._cli.run"

    @classmethod
    def find_spec(cls, fullname: str, path=None, target=None) -> ModuleSpec | None:
        if fullname != cls._MODULE:
            return None
        spec = PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        run_module = spec.loader.exec_module

        def exec_module(module) -> None:
            run_module(module)
            try:
                from exactga.cli import quiet_user_errors_under_torchrun
            except ImportError:  # exactga uninstalled, its start-up files left behind
                return
            quiet_user_errors_under_torchrun(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    for finder in (WorkingDirRecipesFinder, TuneRunPatcher):
        if not any(installed is finder for installed in sys.meta_path):
            sys.meta_path.insert(0, finder)


install()
