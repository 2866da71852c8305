"""Make ``tune run recipes/<name>.py`` run the ``recipes/`` folder of the working directory.

torchtune 0.6.1 installs a top-level ``recipes`` package whose ``__init__`` raises, and
``tune run recipes/x.py`` imports the module ``recipes.x`` with the working directory *last*
on ``sys.path`` (``python -m`` under ``--nproc_per_node`` puts it first, but a regular package
later on the path still beats a plain folder). Either way the installed package wins and the
user's recipe is never run.

This module is imported at interpreter start-up by ``exactga_recipes_path.pth`` and puts one
finder in front of the import system. It answers for exactly one name, ``recipes``, and only
when the working directory has a ``recipes/`` folder; every other import, and every launch from
a directory without one, is untouched. A second finder, :class:`TorchtuneCliPatcher`, adds
exactga's recipes to ``tune ls``/``cp``/``run``, quiets the launcher's traceback after a user
error under torchrun and refuses launch mix-ups. Kept free of heavy imports: it runs in
every interpreter of the environment. See docs/launching.md.
"""

import importlib
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


class TorchtuneCliPatcher:
    """After a module of torchtune's command line is imported, let exactga patch it:

    - ``torchtune._recipe_registry``: exactga's recipes and configs join the built-in ones
      under an ``exactga/`` prefix, for ``tune ls``, ``tune cp`` and ``tune run``
      (``exactga.launch.registry.add_to_torchtune_registry``);
    - ``torchtune._cli.run``: its torchrun path prints a user error's one message and no
      launcher traceback (see [user errors]), and ``tune run`` refuses a launch that would run
      something other than asked, or runs a recipe path it could not import by its path
      (``exactga.launch.cli.patch_tune_run``; see [launch mix-ups]).
    """

    # module imported -> (exactga module, its function that patches it)
    _PATCHES = {
        "torchtune._recipe_registry": ("exactga.launch.registry", "add_to_torchtune_registry"),
        "torchtune._cli.run": ("exactga.launch.cli", "patch_tune_run"),
    }

    @classmethod
    def find_spec(cls, fullname: str, path=None, target=None) -> ModuleSpec | None:
        if fullname not in cls._PATCHES:
            return None
        spec = PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        load_module = spec.loader.exec_module
        patcher_module, patcher_name = cls._PATCHES[fullname]

        def exec_module(module) -> None:
            load_module(module)
            try:
                patcher = getattr(importlib.import_module(patcher_module), patcher_name)
            except (ImportError, AttributeError):  # exactga uninstalled, this file left behind
                return
            patcher(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    for finder in (WorkingDirRecipesFinder, TorchtuneCliPatcher):
        if not any(installed is finder for installed in sys.meta_path):
            sys.meta_path.insert(0, finder)


install()
