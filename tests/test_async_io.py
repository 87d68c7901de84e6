"""zerocore._C.crc32c and zerocore._C.AsyncIO: CRC-32C against test vectors and a pure-Python reference, the
instruction path against the portable one; file round trips through the async engine (any size, offset,
alignment and aio setting, requests waited in any order); errors as OSError naming path, offset and errno."""

from __future__ import annotations

import ctypes
import errno
import gc
import itertools
import os
import random
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zerocore import _C

PAGE = 4096


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------


def crc32c_reference(data: bytes, crc: int = 0) -> int:
    """Bitwise CRC-32C (reflected 0x82F63B78), chainable like zlib.crc32."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def as_tensor(data: bytes) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def to_bytes(t: torch.Tensor) -> bytes:
    assert t.is_contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""


def random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def placed(n: int, phase: int) -> torch.Tensor:
    """A contiguous uint8 tensor of n bytes whose address is phase modulo 4096 (a view into a larger one)."""
    base = torch.empty(n + 2 * PAGE, dtype=torch.uint8)
    shift = (phase - base.data_ptr()) % PAGE
    view = base[shift : shift + n]
    assert n == 0 or view.data_ptr() % PAGE == phase % PAGE
    return view


def direct_io_supported(directory) -> bool:
    path = os.path.join(directory, ".odirect-probe")
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
    except OSError:
        return False
    finally:
        if os.path.exists(path):
            os.unlink(path)
    os.close(fd)
    return True


_counter = itertools.count()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("aio")


def fresh_path(workdir) -> str:
    return str(workdir / f"f{next(_counter)}.bin")


# ---------------------------------------------------------------------------------------------------------
# crc32c
# ---------------------------------------------------------------------------------------------------------

# RFC 3720 (iSCSI) B.4 and the usual check value.
VECTORS = [
    (b"", 0x00000000),
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
]


@pytest.mark.parametrize("path", ["auto", "scalar"])
@pytest.mark.parametrize("data,expected", VECTORS)
def test_crc32c_vectors(data, expected, path):
    if path == "scalar":
        _C.force_simd_path("scalar")
    try:
        assert _C.crc32c(as_tensor(data)) == expected
        assert crc32c_reference(data) == expected
    finally:
        _C.reset_simd_path()


def test_crc32c_covers_the_bytes_of_any_dtype():
    x = torch.linspace(-3, 7, 1001, dtype=torch.float32)
    assert _C.crc32c(x) == _C.crc32c(x.view(torch.uint8))
    b = torch.arange(77, dtype=torch.bfloat16).reshape(7, 11)
    assert _C.crc32c(b) == crc32c_reference(to_bytes(b))
    assert _C.crc32c(torch.tensor(True)) == crc32c_reference(b"\x01")


@given(data=st.binary(max_size=300), crc=st.integers(0, 2**32 - 1))
def test_crc32c_matches_pure_python_reference(data, crc):
    assert _C.crc32c(as_tensor(data), crc) == crc32c_reference(data, crc)


@given(a=st.binary(max_size=2000), b=st.binary(max_size=2000), crc=st.integers(0, 2**32 - 1))
def test_crc32c_chains(a, b, crc):
    assert _C.crc32c(as_tensor(b), _C.crc32c(as_tensor(a), crc)) == _C.crc32c(as_tensor(a + b), crc)


_BIG = random_bytes(3 * 3 * 8192 + 3 * 256 + 200, seed=7)


@given(
    start=st.integers(0, 63),
    length=st.one_of(st.integers(0, 64), st.integers(0, 3 * 256 + 40), st.integers(0, _BIG.numel() - 64)),
    crc=st.integers(0, 2**32 - 1),
)
def test_crc32c_hardware_equals_portable(start, length, crc):
    view = _BIG[start : start + length]  # every address alignment, every length class of the 3-stream code
    fast = _C.crc32c(view, crc)
    _C.force_simd_path("scalar")
    try:
        portable = _C.crc32c(view, crc)
    finally:
        _C.reset_simd_path()
    assert fast == portable


def test_crc32c_large_chained_over_pieces():
    data = random_bytes(5 * 1024 * 1024 + 13, seed=3)
    whole = _C.crc32c(data)
    crc = 0
    for piece in torch.split(data, 1_000_003):
        crc = _C.crc32c(piece, crc)
    assert crc == whole


def test_crc32c_rejects_bad_arguments():
    with pytest.raises(ValueError, match="contiguous"):
        _C.crc32c(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="CPU"):
        _C.crc32c(torch.zeros(4, device="meta"))
    with pytest.raises(ValueError, match=r"crc must be in \[0, 2\*\*32\)"):
        _C.crc32c(torch.zeros(4), -1)
    with pytest.raises(ValueError, match=r"crc must be in \[0, 2\*\*32\)"):
        _C.crc32c(torch.zeros(4), 2**32)


# ---------------------------------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------------------------------

configs = st.fixed_dictionaries(
    {
        "block_size": st.sampled_from([PAGE, 2 * PAGE, 4 * PAGE, 16 * PAGE]),
        "queue_depth": st.integers(1, 6),
        "thread_count": st.integers(1, 4),
        "single_submit": st.booleans(),
        "overlap_events": st.booleans(),
    }
)


@st.composite
def layouts(draw, block_size):
    """Non-overlapping (offset, size, buffer phase) regions of one file."""
    regions = []
    end = draw(st.sampled_from([0, PAGE, 3 * PAGE, draw(st.integers(0, 3 * PAGE))]))
    for _ in range(draw(st.integers(1, 6))):
        size = draw(
            st.one_of(
                st.just(0),
                st.integers(1, 9),
                st.integers(0, 3 * block_size + 5),
                st.integers(1, 3 * block_size // PAGE + 1).map(lambda k: k * PAGE),
            )
        )
        gap = draw(st.sampled_from(["none", "align", "random"]))
        if gap == "align":
            end = -(-end // PAGE) * PAGE
        elif gap == "random":
            end += draw(st.integers(0, 5000))
        offset = end
        # Buffer address in phase with the offset (O_DIRECT for the whole pages) or anywhere.
        phase = offset % PAGE if draw(st.booleans()) else draw(st.integers(0, PAGE - 1))
        regions.append((offset, size, phase))
        end = offset + size
    return regions


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow], deadline=None)
@given(config=configs, data=st.data())
def test_round_trip_any_layout(workdir, config, data):
    regions = data.draw(layouts(config["block_size"]), label="regions")
    order = data.draw(st.permutations(range(len(regions))), label="wait order")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    io = _C.AsyncIO(**config)
    path = fresh_path(workdir)
    handle = io.open(path, "w")
    sources = []
    for i, (offset, size, phase) in enumerate(regions):
        src = placed(size, phase)
        src.copy_(random_bytes(size, seed + i))
        sources.append(src)
    requests = [io.write(handle, offset, src) for (offset, _, _), src in zip(regions, sources)]
    for i in order:
        io.wait(requests[i])
    io.fsync(handle)
    io.close(handle)

    expected = bytearray(max((o + s for o, s, _ in regions if s), default=0))  # an empty write extends nothing
    for (offset, size, _), src in zip(regions, sources):
        expected[offset : offset + size] = to_bytes(src)
    with open(path, "rb") as f:
        assert f.read() == bytes(expected)

    reader = io.open(path, "r")
    targets = [placed(size, phase).fill_(0xA5) for _, size, phase in regions]
    requests = [io.read(reader, offset, t) for (offset, _, _), t in zip(regions, targets)]
    for i in order:
        io.wait(requests[i])
    for src, target in zip(sources, targets):
        assert torch.equal(src, target)
    assert io.pending() == 0
    io.close_all()
    os.unlink(path)


def test_round_trip_large_default_config(workdir):
    io = _C.AsyncIO(thread_count=3)
    path = fresh_path(workdir)
    n = 5 * (1 << 20) + 12345  # > block_size, unaligned tail
    src = placed(n, 0).copy_(random_bytes(n, 11))
    h = io.open(path, "w")
    io.wait(io.write(h, 0, src))
    io.fsync(h)
    assert io.size(h) == n
    io.close(h)
    h = io.open(path, "r")
    dst = placed(n, 0).zero_()
    io.wait(io.read(h, 0, dst))
    assert _C.crc32c(dst) == _C.crc32c(src)
    # Aligned offset and size inside the file: the O_DIRECT path end to end.
    part = placed(2 * (1 << 20), 0).zero_()
    io.wait(io.read(h, 3 * PAGE, part))
    assert torch.equal(part, src[3 * PAGE : 3 * PAGE + part.numel()])
    io.close(h)


def test_float_tensors_and_mixed_reads_and_writes_in_flight(workdir):
    io = _C.AsyncIO(block_size=8 * PAGE, queue_depth=4, thread_count=2)
    path = fresh_path(workdir)
    h = io.open(path, "rw")
    a = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    io.wait(io.write(h, 0, a))
    b = torch.randn(50_000, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    back = torch.empty_like(a)
    reqs = [io.read(h, 0, back), io.write(h, a.numel() * 4, b)]  # disjoint: read one region, write another
    random.Random(0).shuffle(reqs)
    for r in reqs:
        io.wait(r)
    assert torch.equal(back, a)
    b_back = torch.empty_like(b)
    io.wait(io.read(h, a.numel() * 4, b_back))
    assert torch.equal(b_back, b)
    io.close(h)


def test_rw_keeps_the_file_w_truncates_it(workdir):
    io = _C.AsyncIO()
    path = fresh_path(workdir)
    with open(path, "wb") as f:
        f.write(b"x" * 10000)
    h = io.open(path, "rw")
    assert io.size(h) == 10000
    io.wait(io.write(h, 2, as_tensor(b"abc")))
    io.close(h)
    with open(path, "rb") as f:
        assert f.read() == b"xxabc" + b"x" * 9995
    h = io.open(path, "w")
    assert io.size(h) == 0
    io.close(h)
    missing = fresh_path(workdir)
    h = io.open(missing, "rw")  # created
    assert io.size(h) == 0 and os.path.exists(missing)
    io.truncate(h, 5000)
    assert io.size(h) == 5000
    io.close(h)


def test_poll_and_request_lifecycle(workdir):
    io = _C.AsyncIO(block_size=PAGE, queue_depth=2)
    path = fresh_path(workdir)
    h = io.open(path, "w")
    r = io.write(h, 0, random_bytes(300_000, 5))
    while not io.poll(r):
        pass
    assert io.poll(r)  # stays pending until waited
    io.wait(r)
    with pytest.raises(ValueError, match=f"request {r} is not pending"):
        io.wait(r)
    with pytest.raises(ValueError, match="is not pending"):
        io.poll(r)
    with pytest.raises(ValueError, match="is not pending"):
        io.wait(10**9)
    empty = io.write(h, 5, torch.empty(0))
    assert io.poll(empty)
    io.wait(empty)
    io.wait_all()  # nothing pending
    io.close(h)


def test_engine_keeps_tensors_alive_until_waited(workdir):
    io = _C.AsyncIO(block_size=PAGE, queue_depth=1)
    path = fresh_path(workdir)
    h = io.open(path, "w")
    n = 1 << 20
    reqs = [io.write(h, i * n, torch.full((n,), i + 1, dtype=torch.uint8)) for i in range(4)]
    gc.collect()
    for _ in range(4):  # churn the allocator while the writes are in flight
        torch.full((n,), 0xEE, dtype=torch.uint8)
    io.wait_all()
    io.close(h)
    with open(path, "rb") as f:
        data = f.read()
    for i in range(4):
        assert data[i * n : (i + 1) * n] == bytes([i + 1]) * n
    for r in reqs:
        with pytest.raises(ValueError):
            io.poll(r)


def test_close_with_requests_in_flight_and_handles_never_reused(workdir):
    io = _C.AsyncIO(block_size=PAGE, queue_depth=2)
    path = fresh_path(workdir)
    h = io.open(path, "w")
    src = random_bytes(2 << 20, 9)
    r = io.write(h, 0, src)
    io.close(h)  # the request still completes
    io.wait(r)
    with open(path, "rb") as f:
        assert f.read() == to_bytes(src)
    with pytest.raises(ValueError, match=f"handle {h} is not open"):
        io.write(h, 0, src)
    with pytest.raises(ValueError, match="is not open"):
        io.close(h)
    h2 = io.open(path, "r")
    assert h2 != h
    io.close_all()
    with pytest.raises(ValueError, match="is not open"):
        io.direct(h2)


def test_direct_reports_what_the_file_system_allows(workdir):
    io = _C.AsyncIO()
    h = io.open(fresh_path(workdir), "w")
    assert io.direct(h) is direct_io_supported(str(workdir))
    io.close(h)


def test_threads_share_one_engine(workdir):
    io = _C.AsyncIO(block_size=2 * PAGE, queue_depth=3, thread_count=2)
    path = fresh_path(workdir)
    h = io.open(path, "rw")
    n = 40_000
    failures = []

    def worker(k):
        try:
            for j in range(10):
                src = random_bytes(n, 100 * k + j)
                offset = (k * 10 + j) * n
                io.wait(io.write(h, offset, src))
                back = torch.empty(n, dtype=torch.uint8)
                io.wait(io.read(h, offset, back))
                assert torch.equal(back, src)
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    io.close(h)


def test_engine_destroyed_with_requests_pending(workdir):
    path = fresh_path(workdir)
    io = _C.AsyncIO(block_size=PAGE)
    h = io.open(path, "w")
    src = random_bytes(1 << 20, 4)
    io.write(h, 0, src)
    del io  # waits for the write, then closes
    gc.collect()
    with open(path, "rb") as f:
        assert f.read() == to_bytes(src)


# ---------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------


def test_open_missing_file(workdir):
    io = _C.AsyncIO()
    path = str(workdir / "does-not-exist.bin")
    with pytest.raises(FileNotFoundError) as info:
        io.open(path, "r")
    e = info.value
    assert e.errno == errno.ENOENT and e.filename == path
    assert f"cannot open {path} for reading" in str(e) and "No such file or directory" in str(e)


def test_open_in_missing_directory(workdir):
    io = _C.AsyncIO()
    path = str(workdir / "no-such-dir" / "f.bin")
    for mode in ("w", "rw"):
        with pytest.raises(FileNotFoundError) as info:
            io.open(path, mode)
        assert info.value.errno == errno.ENOENT and info.value.filename == path
        assert f"the directory {workdir / 'no-such-dir'} does not exist" in str(info.value)


def test_open_a_directory(workdir):
    io = _C.AsyncIO()
    with pytest.raises(IsADirectoryError) as info:
        io.open(str(workdir), "r")
    assert info.value.filename == str(workdir)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_open_in_read_only_directory(workdir):
    ro = workdir / "read-only"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        io = _C.AsyncIO()
        path = str(ro / "f.bin")
        with pytest.raises(PermissionError) as info:
            io.open(path, "w")
        assert info.value.errno == errno.EACCES and info.value.filename == path
        assert path in str(info.value) and "Permission denied" in str(info.value)
    finally:
        ro.chmod(0o700)


@pytest.mark.parametrize("block_size", [PAGE, 1 << 20])
def test_short_read(workdir, block_size):
    io = _C.AsyncIO(block_size=block_size, queue_depth=4, thread_count=3)
    path = fresh_path(workdir)
    with open(path, "wb") as f:
        f.write(bytes(range(256)) * 40)  # 10240 bytes
    h = io.open(path, "r")
    out = torch.empty(50_000, dtype=torch.uint8)
    with pytest.raises(OSError) as info:
        io.wait(io.read(h, 100, out))
    e = info.value
    assert e.errno == errno.EIO and e.filename == path
    assert f"short read: {path} ends at byte 10240, wanted bytes [100, 50100)" in str(e)
    # Entirely past the end.
    with pytest.raises(OSError, match=r"ends at byte 10240, wanted bytes \[20000, 20001\)"):
        io.wait(io.read(h, 20000, torch.empty(1, dtype=torch.uint8)))
    # The engine goes on: the bytes that exist read fine.
    ok = torch.empty(10240 - 100, dtype=torch.uint8)
    io.wait(io.read(h, 100, ok))
    assert to_bytes(ok) == (bytes(range(256)) * 40)[100:]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("mode", ["w", "rw"])
def test_enospc_on_dev_full(workdir, mode):
    io = _C.AsyncIO(block_size=16 * PAGE, queue_depth=4, thread_count=2)
    h = io.open("/dev/full", mode)
    src = random_bytes(5 * 16 * PAGE + 3, 1)
    good_path = fresh_path(workdir)
    good = io.open(good_path, "w")
    failing = io.write(h, 3 * 16 * PAGE, src)
    fine = io.write(good, 0, src)  # in flight alongside the failing request
    with pytest.raises(OSError) as info:
        io.wait(failing)
    e = info.value
    assert e.errno == errno.ENOSPC and e.filename == "/dev/full"
    assert f"write of {16 * PAGE} bytes at offset {3 * 16 * PAGE} of /dev/full failed: " in str(e)
    assert "No space left on device (errno 28)" in str(e)
    io.wait(fine)
    # After the error the engine still works, and wait_all reports the earliest failed request.
    r1 = io.write(good, len(src), src)
    bad = io.write(h, 0, src)
    r2 = io.write(good, 2 * len(src), src)
    with pytest.raises(OSError, match="at offset 0 of /dev/full"):
        io.wait_all()
    for r in (r1, bad, r2):
        with pytest.raises(ValueError, match="not pending"):
            io.wait(r)
    io.close(good)
    with open(good_path, "rb") as f:
        assert f.read() == to_bytes(src) * 3


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"block_size": 0}, "block_size must be a positive multiple of 4096 bytes, got 0"),
        ({"block_size": 1000}, "block_size must be a positive multiple of 4096 bytes, got 1000"),
        ({"block_size": -4096}, "block_size must be a positive multiple of 4096 bytes, got -4096"),
        ({"block_size": 4096 + 512}, "got 4608"),
        ({"queue_depth": 0}, "queue_depth must be >= 1, got 0"),
        ({"thread_count": 0}, "thread_count must be >= 1, got 0"),
        ({"thread_count": -2}, "thread_count must be >= 1, got -2"),
    ],
)
def test_bad_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _C.AsyncIO(**kwargs)


def test_bad_requests(workdir):
    io = _C.AsyncIO()
    path = fresh_path(workdir)
    with pytest.raises(ValueError, match="open mode must be 'r'"):
        io.open(path, "a")
    w = io.open(path, "w")
    with pytest.raises(ValueError, match="contiguous"):
        io.write(w, 0, torch.zeros(8, 8).t())
    with pytest.raises(ValueError, match="CPU"):
        io.write(w, 0, torch.zeros(8, device="meta"))
    with pytest.raises(ValueError, match="offset must be >= 0, got -1"):
        io.write(w, -1, torch.zeros(8))
    with pytest.raises(ValueError, match="open for writing only"):
        io.read(w, 0, torch.zeros(8))
    io.wait(io.write(w, 0, torch.zeros(8)))
    r = io.open(path, "r")
    with pytest.raises(ValueError, match="open for reading only"):
        io.write(r, 0, torch.zeros(8))
    with pytest.raises(ValueError, match="contiguous"):
        io.read(r, 0, torch.zeros(4, 4)[:, 1])
    # Still fine afterwards.
    back = torch.ones(8)
    io.wait(io.read(r, 0, back))
    assert torch.equal(back, torch.zeros(8))
    io.close_all()


def test_read_into_a_tensor_that_requires_grad(workdir):
    io = _C.AsyncIO()
    path = fresh_path(workdir)
    h = io.open(path, "rw")
    io.wait(io.write(h, 0, torch.arange(4.0)))
    p = torch.zeros(4, requires_grad=True)
    with pytest.raises(ValueError, match="torch.no_grad"):
        io.read(h, 0, p)
    with torch.no_grad():
        version = p._version
        io.wait(io.read(h, 0, p))
    assert p._version > version and torch.equal(p.detach(), torch.arange(4.0))
    io.close(h)


# ---------------------------------------------------------------------------------------------------------
# direct-I/O buffers (Note [Huge pages for direct I/O])
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 4095, 1 << 20, 3 << 20, (8 << 20) + 123])
@pytest.mark.parametrize("skew", [0, 7, 4096 + 100])
def test_aligned_empty_keeps_its_phase_and_large_buffers_start_a_huge_page(n, skew, workdir):
    from zerocore._safetensors_io import aligned_empty

    buffer = aligned_empty(n, skew=skew)
    assert buffer.dtype == torch.uint8 and buffer.numel() == n and buffer.is_contiguous()
    assert buffer.data_ptr() % PAGE == skew % PAGE
    huge = _C.huge_page_size()
    if huge and n >= 2 * huge:
        assert buffer.data_ptr() % huge == skew % PAGE  # within the first page of a huge page
    # a direct read lands in it byte for byte, whatever its phase
    data = torch.randint(0, 256, (n,), dtype=torch.uint8)
    path = os.path.join(workdir, "phase.bin")
    with open(path, "wb") as f:
        f.write(bytes(skew % PAGE) + bytes(data.tolist()))
    io = _C.AsyncIO(block_size=1 << 20, queue_depth=4, thread_count=2)
    handle = io.open(path, "r")
    io.wait(io.read(handle, skew % PAGE, buffer))
    io.close(handle)
    assert torch.equal(buffer, data)


def test_advise_huge_pages_is_advice_only():
    small = torch.arange(1000, dtype=torch.float32)
    assert _C.advise_huge_pages(small) == 0  # holds no whole huge page
    big = torch.arange(3 << 20, dtype=torch.float32)  # 12 MiB
    before = big.clone()
    _C.advise_huge_pages(big)
    assert torch.equal(big, before)
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        _C.advise_huge_pages(big[::2])
