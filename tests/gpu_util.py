"""Helpers for gpu tests: the driver's own figures (cuda.bindings), an oracle
independent of bridge."""

from __future__ import annotations

GIB = 1 << 30
MIB = 1 << 20

USED = "CU_MEMPOOL_ATTR_USED_MEM_CURRENT"
RESERVED = "CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT"
THRESHOLD = "CU_MEMPOOL_ATTR_RELEASE_THRESHOLD"


def _cu():
    from cuda.bindings import driver as cu

    (err,) = cu.cuInit(0)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    return cu


def driver_pool_attr(name: str, device: int = 0) -> int:
    """An attribute of the device's default pool, read with cuda.bindings."""
    cu = _cu()
    err, pool = cu.cuDeviceGetDefaultMemPool(device)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    err, value = cu.cuMemPoolGetAttribute(pool, getattr(cu.CUmemPool_attribute, name))
    assert err == cu.CUresult.CUDA_SUCCESS, err
    return int(value)


def device_bytes(ptr: int, n: int) -> bytes:
    """Copy n bytes of device memory to the host with the driver (synchronous)."""
    cu = _cu()
    host = bytearray(n)
    (err,) = cu.cuMemcpyDtoH(host, ptr, n)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    return bytes(host)


def memset(ptr: int, value: int, n: int) -> None:
    cu = _cu()
    (err,) = cu.cuMemsetD8(ptr, value, n)
    assert err == cu.CUresult.CUDA_SUCCESS, err


def ctx_sync() -> None:
    cu = _cu()
    (err,) = cu.cuCtxSynchronize()
    assert err == cu.CUresult.CUDA_SUCCESS, err
