"""The CPU probe: pure parsers on fixed text, and one real probe of this machine."""

from __future__ import annotations

import msgspec

from hardware_agents.cpu import (
    CpuCapabilities,
    host_id,
    isa_from_flags,
    parse_cpuinfo,
    parse_meminfo,
    parse_size,
    physical_cores_from_cpuinfo,
    probe,
)

X86_FLAGS = "fpu sse sse2 sse4_1 sse4_2 avx avx2 fma avx512f avx512bw avx512vl avx512_bf16 amx_tile"
#: three logical processors on two cores (0 and 1 are hyperthreads of core 0)
X86_CPUINFO = "\n".join(
    f"processor\t: {n}\n"
    "vendor_id\t: GenuineIntel\n"
    "model name\t: Intel(R) Xeon(R) Platinum 8480+\n"
    "physical id\t: 0\n"
    f"core id\t\t: {core}\n"
    f"flags\t\t: {X86_FLAGS}\n"
    for n, core in enumerate((0, 0, 1))
)

ARM_FEATURES = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp sve sve2 bf16 i8mm"
#: two processors, with no core ids
ARM_CPUINFO = "\n".join(
    f"processor\t: {n}\n"
    "BogoMIPS\t: 50.00\n"
    f"Features\t: {ARM_FEATURES}\n"
    "CPU implementer\t: 0x41\n"
    "CPU part\t: 0xd4f\n"
    for n in range(2)
)


def test_parse_size_reads_sysfs_and_lscpu_forms() -> None:
    """Sizes with binary suffixes, optional ``iB`` and plain byte counts all parse."""
    assert parse_size("32K") == 32 * 1024
    assert parse_size("2048 KiB") == 2 * 1024 * 1024
    assert parse_size("1 MB") == 1024 * 1024
    assert parse_size("65536") == 65536
    assert parse_size("307200K\n") == 300 * 1024 * 1024


def test_parse_size_rejects_garbage() -> None:
    """Text that is not a size gives None rather than a guess."""
    assert parse_size("") is None
    assert parse_size("large") is None
    assert parse_size("12 parsecs") is None


def test_parse_cpuinfo_splits_processor_blocks() -> None:
    """Each ``processor`` block becomes one dict with trimmed keys and values."""
    processors = parse_cpuinfo(X86_CPUINFO)
    assert len(processors) == 3
    assert processors[0]["model name"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert processors[2]["core id"] == "1"


def test_physical_cores_counts_distinct_core_ids() -> None:
    """Hyper-threads sharing a core id count once."""
    assert physical_cores_from_cpuinfo(parse_cpuinfo(X86_CPUINFO)) == 2
    assert physical_cores_from_cpuinfo(parse_cpuinfo(ARM_CPUINFO)) is None


def test_isa_from_flags_keeps_relevant_extensions_sorted() -> None:
    """Only kernel-relevant x86 extensions are kept, in sorted order."""
    flags = parse_cpuinfo(X86_CPUINFO)[0]["flags"]
    isa = isa_from_flags(flags)
    assert isa == tuple(sorted(isa))
    assert {"avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "sse4_2"} <= set(isa)
    assert "fpu" not in isa


def test_isa_from_flags_names_neon_on_arm() -> None:
    """ARM's ``asimd`` is reported as both ``asimd`` and ``neon``, with SVE kept."""
    isa = isa_from_flags(parse_cpuinfo(ARM_CPUINFO)[0]["Features"])
    assert {"asimd", "neon", "sve", "sve2", "bf16"} <= set(isa)
    assert "aes" not in isa


def test_parse_meminfo_reads_memtotal_in_bytes() -> None:
    """``MemTotal`` in kB becomes bytes; text without it gives None."""
    text = "MemTotal:       16384000 kB\nMemFree:         1000 kB\n"
    assert parse_meminfo(text) == 16384000 * 1024
    assert parse_meminfo("MemFree: 1 kB\n") is None


def test_probe_without_measurement_describes_this_host() -> None:
    """A probe with ``measure=False`` fills the basic fields and measures nothing."""
    caps = probe(measure=False)
    assert caps.device == "cpu"
    assert caps.logical_cores >= 1
    assert caps.arch
    assert caps.measured_copy_bandwidth_gbs is None
    assert caps.measured_gflops is None
    assert all(size > 0 for size in caps.caches.values())
    if caps.compilers.keys() - {"nvcc"}:
        assert "cpp-openmp" in caps.backends


def test_probe_capabilities_round_trip_through_msgpack() -> None:
    """Capabilities survive a msgpack encode/decode unchanged, as inside an event."""
    caps = probe(measure=False)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(caps), type=CpuCapabilities)
    assert decoded == caps


def test_capabilities_decode_with_only_basic_fields() -> None:
    """An old message carrying only the basic fields still decodes, with defaults for the rest."""
    raw = msgspec.json.encode({"model": "m", "vendor": "v", "arch": "x86_64", "logical_cores": 4})
    caps = msgspec.json.decode(raw, type=CpuCapabilities)
    assert caps.device == "cpu"
    assert caps.isa == ()
    assert caps.measured_copy_bandwidth_gbs is None


def test_probe_with_measurement_reports_positive_bandwidth() -> None:
    """A measuring probe reports a positive copy bandwidth and matmul rate."""
    caps = probe(measure=True)
    assert caps.measured_copy_bandwidth_gbs is not None
    assert caps.measured_copy_bandwidth_gbs > 0
    assert caps.measured_gflops is not None
    assert caps.measured_gflops > 0


def test_host_id_is_stable_and_subject_safe() -> None:
    """``host_id`` returns the same slug each call, using only ``[a-z0-9-]``."""
    first = host_id()
    assert first == host_id()
    assert first
    assert all(c.isascii() and (c.isalnum() or c == "-") for c in first)
    assert first == first.lower()
