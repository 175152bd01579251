r"""A numba compiler pipeline whose kernels may use 512-bit vectors (``wide`` kernels).

On CPUs with AVX-512, LLVM's x86 back end still vectorizes loops with 256-bit
registers by default (the ``prefer-256-bit`` tuning of those CPUs), and numba has
no switch for one function: ``NUMBA_CPU_FEATURES`` changes the code of every
function in the process, the user's included. LLVM reads the function attribute
``"prefer-vector-width"="512"`` per function instead, so this pipeline lowers a
kernel as numba does and adds that attribute to it; the loop vectorizer then picks
512-bit registers for that function only. On a CPU without AVX-512 the widest
registers are 256 bits and the attribute changes nothing.

The width changes no result: without ``fastmath`` the vectorizer keeps every sum in
the order written, whatever the width (the SSD kernels' tests compare bits).
Whether it pays depends on the loops: measured on the development machine (Xeon,
AVX-512, two cores), SSD's row-batched kernel (its loops run over 64 rows) took
0.89-0.97x its time with it at K = 2 to 16, while the row kernel, whose loops run
over a row's K entries with a remainder, took 1.04-1.16x at K = 10 and 100. So
a kernel opts in (:func:`defenses.jit.vectorizable` with ``wide=True``).

Built on numba's compiler classes (``Lower``, ``NativeLowering``, the nopython
pipeline); where they differ from what this module expects, :data:`PIPELINE` is
None and wide kernels compile as the others.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

logger = logging.getLogger(__name__)

ATTRIBUTE = '"prefer-vector-width"="512"'
"""The LLVM function attribute (string form) added to a wide kernel."""


def _pipeline() -> Any:
    """Numba's nopython compiler with the attribute added at lowering, or None."""
    try:
        attributes: Any = importlib.import_module("llvmlite.ir.values")
        lowering: Any = importlib.import_module("numba.core.lowering")
        compiler: Any = importlib.import_module("numba.core.compiler")
        machinery: Any = importlib.import_module("numba.core.compiler_machinery")
        typed_passes: Any = importlib.import_module("numba.core.typed_passes")
    except ImportError as error:
        logger.info("no wide kernels with this numba: %s", error)
        return None
    native = getattr(typed_passes, "NativeLowering", None)
    if not (
        issubclass(getattr(attributes, "FunctionAttributes", type), set)
        and hasattr(getattr(lowering, "Lower", None), "pre_lower")
        and isinstance(getattr(native, "lowering_class", None), property)
        and hasattr(
            getattr(compiler, "DefaultPassBuilder", None), "define_nopython_pipeline"
        )
    ):
        logger.info("no wide kernels with this numba: its lowering classes differ")
        return None

    class WideLower(lowering.Lower):  # type: ignore[misc]
        """numba's lowering, with the attribute on the function it defines."""

        def pre_lower(self) -> None:
            super().pre_lower()
            # llvmlite's attribute set takes only enum attributes by name; the set
            # itself holds any string and prints it in the function's definition
            set.add(self.builder.function.attributes, ATTRIBUTE)

    @machinery.register_pass(mutates_CFG=True, analysis_only=False)
    class WideLowering(native):  # type: ignore[misc,valid-type]
        """numba's native lowering pass with :class:`WideLower`."""

        _name = "defenses_wide_native_lowering"

        @property
        def lowering_class(self) -> type:
            return WideLower

    class WideCompiler(compiler.CompilerBase):  # type: ignore[misc]
        """numba's nopython pipeline with :class:`WideLowering` for its lowering."""

        def define_pipelines(self) -> list[Any]:
            manager = compiler.DefaultPassBuilder.define_nopython_pipeline(self.state)
            manager.passes = [
                (WideLowering if step is native else step, description)
                for step, description in manager.passes
            ]
            manager.finalize()
            return [manager]

    return WideCompiler


PIPELINE: Any = _pipeline()
"""The ``pipeline_class`` of wide kernels (None where numba's classes differ)."""
