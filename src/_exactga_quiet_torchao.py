"""Drop torchao's start-up warning about its C++ extensions, and nothing else.

torchao loads its compiled kernels only under the exact torch release it was built for, and
otherwise logs "Skipping import of cpp extensions due to incompatible torch version ..." on
its ``torchao`` logger. torchtune 0.6.1 imports torchao on every ``tune run`` (three times under
torchrun: the launcher and each rank), and our default pins (torch 2.13, torchao 0.13-0.15,
the releases that torchtune 0.6.1 still imports) never match, so every launch printed it.
The skipped kernels are torchao's own custom operators (low-bit GPU matmuls and quantisation
kernels); no exactga recipe calls them: NF4 (QLoRA) and torchao's optimizers are written in
PyTorch. So this one record is filtered, by its message, on that one logger. Every other
torchao message is untouched, and ``EXACTGA_SHOW_TORCHAO_WARNING=1`` keeps this one too.

Imported at interpreter start-up by ``exactga_quiet_torchao.pth``, before torchao is imported;
kept to the standard library's ``logging`` for that reason. See docs/quickstart.md.
"""

import logging
import os

_SKIPPED_EXTENSIONS = "Skipping import of cpp extensions due to incompatible torch version"


class TorchaoExtensionsWarningFilter(logging.Filter):
    """Reject the incompatible-torch-version record; pass every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_SKIPPED_EXTENSIONS)


def install() -> None:
    if os.environ.get("EXACTGA_SHOW_TORCHAO_WARNING") == "1":
        return
    logger = logging.getLogger("torchao")
    if not any(isinstance(f, TorchaoExtensionsWarningFilter) for f in logger.filters):
        logger.addFilter(TorchaoExtensionsWarningFilter())


install()
