"""LMCache pieces for the serde tests: MemoryObjs from LMCache's own L1 manager, a variable-size in-memory
L2 adapter (what PR #3796's size lookup gives the fs adapter), and waiting on LMCache's async tasks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.config import L1ManagerConfig, L1MemoryManagerConfig
from lmcache.v1.distributed.error import L1Error
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l1_manager import L1Manager
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform import create_event_notifier

T = TypeVar("T")
WAIT_S = 120.0  # generous: a 2-core CI runner codes a SmolLM2-sized chunk in seconds, not minutes


def l1_manager(megabytes: int = 256) -> L1Manager:
    """LMCache's L1 manager on host memory (no shared-memory segment)."""
    memory = L1MemoryManagerConfig(size_in_bytes=megabytes << 20, use_lazy=False, shm_name="")
    return L1Manager(L1ManagerConfig(memory_config=memory))


def key(i: int, model: str = "test/model") -> ObjectKey:
    return ObjectKey(chunk_hash=i.to_bytes(8, "little") + b"chunk", model_name=model, kv_rank=0)


def memory_objs(l1: L1Manager, keys: list[ObjectKey], shape, dtype, tag: str = "test") -> list[MemoryObj]:
    """Write-reserved L1 objects of one layout, as the store/prefetch controllers get them."""
    results = l1.reserve_write(keys, [False] * len(keys), MemoryLayoutDesc([torch.Size(shape)], [dtype]), tag=tag)
    assert all(results[k][0] == L1Error.SUCCESS for k in keys), results
    return [results[k][1] for k in keys]


def wait_for(poll: Callable[[], T | None], what: str) -> T:
    """Poll until ``poll()`` gives a result (LMCache's submit/query pattern)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        result = poll()
        if result is not None:
            return result
        time.sleep(0.01)
    raise TimeoutError(f"{what} did not complete within {WAIT_S} s")


def wait_store(adapter: L2AdapterInterface, task: L2TaskId) -> L2StoreResult:
    done: dict = {}

    def poll():
        done.update(adapter.pop_completed_store_tasks())
        return done.get(task)

    return wait_for(poll, "store task")


def wait_load(adapter: L2AdapterInterface, task: L2TaskId) -> Bitmap:
    return wait_for(lambda: adapter.query_load_result(task), "load task")


class VariableSizeL2Adapter(L2AdapterInterface):
    """An in-memory L2 adapter that keeps each object's real size and reads it back into the front of the
    (larger) buffer it is given: the behaviour a serde with variable-size output needs (LMCache's mock
    adapter copies whole tensors and requires equal sizes). Tasks complete synchronously."""

    def __init__(self) -> None:
        super().__init__()
        self.stored: dict[ObjectKey, bytes] = {}
        self._lock = threading.Lock()
        self._next = 0
        self._stores: dict[L2TaskId, L2StoreResult] = {}
        self._lookups: dict[L2TaskId, Bitmap] = {}
        self._loads: dict[L2TaskId, Bitmap] = {}
        self._store_efd, self._lookup_efd, self._load_efd = (create_event_notifier() for _ in range(3))

    def _task(self) -> L2TaskId:
        with self._lock:
            self._next += 1
            return self._next

    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        task = self._task()
        total = 0
        for k, obj in zip(keys, objects, strict=True):
            data = bytes(obj.byte_array)  # the object's logical size: set_used_size narrows it
            self.stored[k] = data
            total += len(data)
        with self._lock:
            self._stores[task] = L2StoreResult(True, total)
        self._store_efd.notify()
        return task

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._stores = self._stores, {}
        return done

    def submit_lookup_and_lock_task(self, keys: list[ObjectKey], group_layout_descs) -> L2TaskId:
        task = self._task()
        bitmap = Bitmap(len(keys))
        for i, k in enumerate(keys):
            if k in self.stored:
                bitmap.set(i)
        with self._lock:
            self._lookups[task] = bitmap
        self._lookup_efd.notify()
        return task

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._lookups.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        pass

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        task = self._task()
        bitmap = Bitmap(len(keys))
        for i, (k, obj) in enumerate(zip(keys, objects, strict=True)):
            data = self.stored.get(k)
            out = obj.tensor.reshape(-1).view(torch.uint8)
            if data is None or len(data) > out.numel():
                continue
            out[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            bitmap.set(i)
        with self._lock:
            self._loads[task] = bitmap
        self._load_efd.notify()
        return task

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._loads.pop(task_id, None)

    def close(self) -> None:
        for efd in (self._store_efd, self._lookup_efd, self._load_efd):
            efd.close()
