"""Helpers shared by the compiled-kernel tests of quant/ (INT4 and FP4)."""

from quantkit.quant import int4


def break_kernel(monkeypatch, owner, name: str) -> None:
    """Kernel `name` of `owner`'s compiled module (quantkit.quant.int4 or .fp4) raises, as a kernel that cannot
    compile here would. Both modules' handles are restored after the test (a failing kernel switches the
    native paths off)."""
    mod = owner._native_module()

    def broken(*a, **k):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(mod, name, broken)
    monkeypatch.setattr(int4, "_NATIVE", int4._native_module())
    monkeypatch.setattr(owner, "_NATIVE", mod)
