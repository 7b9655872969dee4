"""Arguments packed where the kernel reads them (issue 39): at the offsets the driver reports.

The compiler aligns a kernel parameter at its address in constant bank 0, where the parameters start at 0x210 on
sm_90, so a 64-aligned 128-byte struct (a ``CUtensorMap``) after an ``int`` is at offset 48, not at 64 as C
alignment from offset 0 would put it; cuFuncGetParamInfo / cuKernelGetParamInfo report it.  The fake driver
(tests/fakedriver.c) lays out a ``<size>@<alignment>`` parameter the same way, reports it, copies a
``"buffer"`` block verbatim and places each ``kernelParams`` value at its own offset, then records the bytes as
the kernel would see them (``fk.last_launch``): so a block packed anywhere else shows up here.

Where the driver cannot say (before CUDA 12.4), natural alignment is all cuproc has: a ``"buffer"`` launch of a
parameter aligned beyond 16 bytes is refused before the driver call, naming the kernel and what to do.
"""
from __future__ import annotations

import numpy as np
import pytest

import cuproc
from cuproc import DeviceBuffer, Graph, Library, Module
from cuproc.errors import InvalidValueError
from cuproc.launch import Function, launch, launch_ex, pack_bytes
from cuproc.tensor_map import TensorMap, param_type

from fakedriver import fake_image
from threads import in_thread

# tma_load_tile(int tag, const __grid_constant__ CUtensorMap tmap, float* out, int tiles_x), as the GPU test's
# kernel; "far": a pointer the driver puts past its natural place (an 8-byte parameter aligned to 32), which
# the compiled launcher (pointers and scalars only) writes at the offset it is given
IMAGE = fake_image({"tma": [4, "128@64", 8, 4], "far": [4, "8@32", 4], "plain": [4, 8, 4]})
TMA_SIGNATURE = ["int", param_type(), "float*", "int"]
FAR_SIGNATURE = PLAIN_SIGNATURE = ["int", "float*", "int"]
MAP = bytes(range(128))                       # the map's 128 bytes: every byte different


@pytest.fixture()
def kernels(fk, pc):
    mod = Module.load(IMAGE)
    yield mod
    mod.unload()


def _natural(signature) -> list[int]:
    return cuproc.launch.layout([cuproc.launch.arg_type(s) for s in signature])[0]


def _assert_at(data: bytes, info, values) -> None:
    """Each value's bytes at the driver's offset for it."""
    for (offset, size), value in zip(info, values):
        assert data[offset:offset + size] == value, f"parameter at {offset}"


def _expected(out: DeviceBuffer) -> list[bytes]:
    return [(7).to_bytes(4, "little"), MAP, out.ptr.to_bytes(8, "little"), (3).to_bytes(4, "little")]


def test_the_fake_places_the_map_as_sm_90_does_and_not_where_c_alignment_would(kernels):
    info = kernels.get_function("tma").param_info()
    assert info == [(0, 4), (48, 128), (176, 8), (184, 4)]
    assert [o for o, _ in info] != _natural(TMA_SIGNATURE)      # what the tests below tell apart


@pytest.mark.parametrize("convention", ["buffer", "params"])
@pytest.mark.parametrize("form", ["one-shot", "prepared", "prepared per call", "other thread"])
def test_arguments_land_at_the_drivers_offsets(kernels, fk, form, convention):
    fn = kernels.get_function("tma")
    info = fn.param_info()
    with DeviceBuffer(64) as out:
        values = (7, MAP, out, 3)
        if form == "one-shot":
            launch(fn, 1, 1, values, signature=TMA_SIGNATURE, convention=convention)
            launch(fn, 1, 1, values, signature=TMA_SIGNATURE, convention=convention)   # the cached entry
        elif form == "prepared":
            fn.prepare(TMA_SIGNATURE, 1, 1, convention=convention)(*values)
        elif form == "prepared per call":
            run = fn.prepare(TMA_SIGNATURE, 1, 1, convention=convention)
            run(*values)
            run(8, bytes(128), out, 4)
            run(*values)
        else:   # another thread packs a block of its own: at the same offsets
            run = fn.prepare(TMA_SIGNATURE, 1, 1, convention=convention)
            run(1, bytes(128), out, 1)                 # this thread owns the shared block
            assert in_thread(lambda: run(*values)) == {"value": None}
        name, data = fk.last_launch()
        assert name == "tma"
        _assert_at(data, info, _expected(out))


@pytest.mark.parametrize("form", ["launch_ex", "cooperative", "graph node"])
def test_the_kernel_params_forms_pack_at_the_drivers_offsets_too(kernels, fk, form):
    fn = kernels.get_function("tma")
    info = fn.param_info()
    with DeviceBuffer(64) as out:
        values = (7, MAP, out, 3)
        if form == "launch_ex":
            launch_ex(fn, 1, 1, values, signature=TMA_SIGNATURE)
        elif form == "cooperative":
            launch(fn, 1, 1, values, signature=TMA_SIGNATURE, cooperative=True)
        else:
            g = Graph()
            node = g.add_kernel(fn, 1, 1, values, signature=TMA_SIGNATURE)
            _assert_at(node.params.arg_bytes, info, _expected(out))      # read back in the kernel's layout
            assert node.params.arg_bytes == pack_bytes(TMA_SIGNATURE, values, function=fn)
            g.instantiate().launch()
        _assert_at(fk.last_launch()[1], info, _expected(out))


def test_a_library_kernel_packs_at_the_offsets_cuKernelGetParamInfo_reports(kernels, fk):
    with Library(IMAGE) as lib, DeviceBuffer(64) as out:
        kernel = lib.get_kernel("tma")
        info = kernel.param_info()
        assert [o for o, _ in info] != _natural(TMA_SIGNATURE)
        kernel.prepare(TMA_SIGNATURE, 1, 1)(7, MAP, out, 3)
        _assert_at(fk.last_launch()[1], info, _expected(out))


@pytest.mark.parametrize("convention", ["buffer", "params"])
def test_pointers_and_scalars_away_from_their_natural_place(kernels, fk, convention):
    """Only pointers and scalars: the compiled launcher's case where it is built, writing at the offsets
    it was given (it gives any other call to the Python one, which must agree)."""
    fn = kernels.get_function("far")
    info = fn.param_info()
    assert [o for o, _ in info] != _natural(FAR_SIGNATURE)
    with DeviceBuffer(64) as a, DeviceBuffer(64) as b:
        run = fn.prepare(FAR_SIGNATURE, 1, 1, convention=convention)
        for i, buf in enumerate((a, b, a)):
            run(i, buf, i + 10)
            _assert_at(fk.last_launch()[1], info, [i.to_bytes(4, "little"), buf.ptr.to_bytes(8, "little"),
                                                   (i + 10).to_bytes(4, "little")])
        if hasattr(run, "fallbacks"):   # the compiled launcher: the first call claims the block in Python,
            assert run.fallbacks == 1   # the C code stores the others
        for i in range(2):
            fn.launch(1, 1, (np.int32(i), a, np.int32(5)))
            _assert_at(fk.last_launch()[1], info, [i.to_bytes(4, "little"), a.ptr.to_bytes(8, "little"),
                                                   (5).to_bytes(4, "little")])


def test_a_wrong_count_or_size_is_still_refused(kernels, fk):
    fn = kernels.get_function("tma")
    fk.clear_calls()
    with pytest.raises(InvalidValueError, match="takes 4 parameters"):
        fn.prepare(["int", param_type()], 1, 1)
    with pytest.raises(InvalidValueError, match="parameter 2 is 8 bytes"):
        launch(fn, 1, 1, (7, MAP, 0, 3), signature=["int", param_type(), "int", "int"])
    assert fk.launch_count() == 0


def _forget_param_info(monkeypatch) -> None:
    """From now on the driver cannot report parameter offsets (before CUDA 12.4: no cuFuncGetParamInfo)."""
    monkeypatch.setattr(Function, "param_info", lambda self: None)


@pytest.mark.parametrize("form", ["one-shot", "prepared", "inferred"])
def test_without_param_info_a_buffer_launch_of_a_64_aligned_parameter_is_refused(kernels, fk, monkeypatch, form):
    fn = kernels.get_function("tma")
    _forget_param_info(monkeypatch)
    fk.clear_calls()
    with DeviceBuffer(64) as out, DeviceBuffer(1024) as data:
        with pytest.raises(InvalidValueError) as refused:
            if form == "one-shot":
                launch(fn, 1, 1, (7, MAP, out, 3), signature=TMA_SIGNATURE)    # "buffer" is the default
            elif form == "prepared":
                fn.prepare(TMA_SIGNATURE, 1, 1, convention="buffer")
            else:                                      # a TensorMap carries its C type: no signature
                tm = TensorMap.tiled(data, "float32", (16, 16), (4, 4))
                launch(fn, 1, 1, (np.int32(7), tm, out, np.int32(3)))
        text = str(refused.value)
        assert "tma" in text and "parameter 1" in text and "convention='params'" in text
    assert fk.launch_count() == 0


def test_without_param_info_the_params_convention_lets_the_driver_place_each_value(kernels, fk, monkeypatch):
    fn, plain = kernels.get_function("tma"), kernels.get_function("plain")
    info, plain_info = fn.param_info(), plain.param_info()      # what the driver does with the values
    _forget_param_info(monkeypatch)
    with DeviceBuffer(64) as out:
        fn.prepare(TMA_SIGNATURE, 1, 1, convention="params")(7, MAP, out, 3)
        _assert_at(fk.last_launch()[1], info, _expected(out))
        # parameters aligned to 16 bytes or less sit where the kernel reads them on every architecture: a
        # packed buffer of them is sent as before
        plain.prepare(PLAIN_SIGNATURE, 1, 1, convention="buffer")(7, out, 3)
        _assert_at(fk.last_launch()[1], plain_info, [(7).to_bytes(4, "little"), out.ptr.to_bytes(8, "little"),
                                                     (3).to_bytes(4, "little")])


def test_the_driver_is_asked_for_a_functions_parameters_once(kernels, fk):
    """launch_ex, cooperative launches and graph nodes pack on every call; the parameter info they place by
    is the function's, asked once."""
    fn = kernels.get_function("tma")
    with DeviceBuffer(64) as out:
        launch_ex(fn, 1, 1, (7, MAP, out, 3), signature=TMA_SIGNATURE)
        fk.clear_calls()
        launch_ex(fn, 1, 1, (7, MAP, out, 3), signature=TMA_SIGNATURE)
        launch(fn, 1, 1, (7, MAP, out, 3), signature=TMA_SIGNATURE, cooperative=True)
        assert not any("ParamInfo" in name for name in fk.calls()), fk.calls()
