"""The CUDA devices this process sees (by UUID, never by index), and the simulated ones of `fake_gpus`."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ...config import parse_fake_gpus
from ...cuda import fake_uuid

log = logging.getLogger("modelcache.gpu")


@dataclass
class GpuDevice:
    index: int
    uuid: str
    name: str
    total_bytes: int


def probe() -> list[GpuDevice]:
    """CUDA devices visible to this process, or [] when cupy or a GPU is missing."""
    try:
        import cupy  # noqa: F401  (the [gpu] extra)
        from cupy.cuda import runtime
        count = runtime.getDeviceCount()
    except Exception:  # ImportError, CUDARuntimeError: no GPU tier here
        return []
    devices = []
    for i in range(count):
        props = runtime.getDeviceProperties(i)
        uuid = device_uuid(i, props.get("uuid", b""), _runtime_uuid)
        if uuid is None:
            log.warning("CUDA device %d: its UUID could not be read whole; it gets no GPU tier", i)
            continue
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        devices.append(GpuDevice(i, uuid, name, int(props["totalGlobalMem"])))
    return devices


def device_uuid(index: int, cupy_uuid, read_whole) -> str | None:
    """Device `index`'s UUID as 32 hex digits, the client's name for it (cuda.normalize_uuid).

    cupy's getDeviceProperties()["uuid"] is a C char[16] that Cython turned into bytes as if it were
    a string: cut at its first zero byte (about one GPU in 16 has one; fbpic#718 saw 14 bytes). So the
    whole 16 bytes are read through the CUDA runtime as the client reads them (`read_whole(index)`);
    cupy's value serves only when that fails and it has all 16 bytes. None when neither does."""
    try:
        return read_whole(index)
    except Exception as e:   # DeviceError: no libcudart found in this process, a failed call
        log.debug("CUDA device %d: reading its UUID through the runtime failed: %s", index, e)
    if isinstance(cupy_uuid, (bytes, bytearray)) and len(cupy_uuid) == 16:
        return bytes(cupy_uuid).hex()
    return None


def _runtime_uuid(index: int) -> str:
    from ..cuda import cuda_runtime
    return cuda_runtime().uuid_of(index)


def fake_devices(spec: str) -> list[GpuDevice]:
    """The devices of the `fake_gpus` setting: "2x256M" = two devices of 256 MiB, "1G" = one, "" = none."""
    count, total = parse_fake_gpus(spec)
    return [GpuDevice(i, fake_uuid(i), "fake-gpu", total) for i in range(count)]
