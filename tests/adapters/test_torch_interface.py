# SPDX-License-Identifier: Apache-2.0
"""Which torch the bridge's torch allocator builds against, and what it says when it cannot.

adapters/torch_interface.py reads torch's allocator headers before the build:
the defines of the methods torch added after 2.11, and the pure virtual
methods the C++ source does not implement. Here against small headers shaped
as torch 2.11's and 2.12's (2.12 added the pure virtual
``attachOomRejectionObserver``) and one of a torch that adds a method the
bridge does not know; the build's failure words (the compiler's first error,
the torch version), ``build-torch`` without torch, and doctor's words. No torch
needed; where one is installed, its own headers are read too.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from bridge.adapters import native_build, torch_build, torch_interface
from bridge.tools.cli import main

# CUDAAllocator as torch 2.11 declares it (the methods' shapes, abridged to what matters:
# pure and not, on one line and on several, commented-out text that must not count)
CUDA_ALLOCATOR_211 = """
namespace c10::cuda::CUDACachingAllocator {
using OutOfMemoryObserver = std::function<void(int64_t, size_t, size_t, size_t)>;
// virtual void commentedOut() = 0;
class CUDAAllocator : public DeviceAllocator {
 public:
  virtual void* raw_alloc(size_t nbytes) = 0;
  virtual void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) = 0;
  virtual void raw_delete(void* ptr) = 0;
  virtual void init(int device_count) = 0;
  virtual double getMemoryFraction(c10::DeviceIndex device) {
    TORCH_CHECK(false, name(), " does not yet support getMemoryFraction. (x)");
    return 0;
  }
  virtual void setMemoryFraction(double fraction, c10::DeviceIndex device) = 0;
  /* virtual void alsoCommentedOut() = 0; */
  virtual void recordHistory(
      bool enabled,
      CreateContextFn context_recorder,
      size_t alloc_trace_max_entries,
      RecordContext when,
      bool clearHistory,
      const std::vector<std::string>& skip_actions) = 0;
  virtual std::string getUserMetadata() {
    return "";
  }
  virtual void attachOutOfMemoryObserver(OutOfMemoryObserver observer) = 0;
  virtual std::string name() = 0;
};
inline void raw_delete(void* ptr) { get()->raw_delete(ptr); }
}
"""
_ATTACH = "  virtual void attachOutOfMemoryObserver(OutOfMemoryObserver observer) = 0;\n"
# torch 2.12: the rejection observers (with throw_on_cudamalloc_oom and num_oom_rejections)
CUDA_ALLOCATOR_212 = CUDA_ALLOCATOR_211.replace(
    _ATTACH,
    _ATTACH
    + "  virtual void attachOomRejectionObserver(OomRejectionObserver observer) = 0;\n"
    + "  virtual DataPtr allocateWithAddress(size_t size, void* addr) {\n"
    + '    TORCH_CHECK(false, name(), " does not yet support allocateWithAddress.");\n  }\n',
)
DEVICE_ALLOCATOR = """
struct C10_API DeviceAllocator : public c10::Allocator {
  DeviceAllocator();
  ~DeviceAllocator() override;
  virtual bool initialized() = 0;
  virtual void emptyCache(MempoolId_t mempool_id = {0, 0}) = 0;
  virtual CachingDeviceAllocator::DeviceStats getDeviceStats(
      c10::DeviceIndex device) = 0;
  virtual std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) {
    return {0, 0};
  }
};
"""
ALLOCATOR = """
struct C10_API Allocator {
  virtual ~Allocator() = default;
  virtual DataPtr allocate(size_t n) = 0;
  virtual DeleterFnPtr raw_deleter() const {
    return nullptr;
  }
  virtual void copy_data(void* dest, const void* src, std::size_t count)
      const = 0;
};
struct C10_API MemoryReportingInfoBase : public c10::DebugInfoBase {
  virtual bool memoryProfilingEnabled() const = 0;
};
"""


def fake_torch(root: Path, version: str, allocator: str, *, rejections: bool) -> Path:
    """A torch folder with its version.py and the allocator headers (``root/torch``)."""
    torch = root / "torch"
    inc = torch / "include" / "c10"
    (inc / "cuda").mkdir(parents=True)
    (inc / "core").mkdir(parents=True)
    (torch / "version.py").write_text(f"__version__ = '{version}'\ncuda = '13.0'\n")
    (torch / "__init__.py").write_text("raise ImportError('the tests never import it')\n")
    (inc / "cuda" / "CUDACachingAllocator.h").write_text(allocator)
    stats = "  int64_t num_oom_rejections = 0;\n" if rejections else ""
    (inc / "core" / "CachingDeviceAllocator.h").write_text(
        f"struct DeviceStats {{\n{stats}}};\n" + DEVICE_ALLOCATOR
    )
    (inc / "core" / "Allocator.h").write_text(ALLOCATOR)
    config = (
        "  static bool throw_on_cudamalloc_oom() {\n    return true;\n  }\n" if rejections else ""
    )
    (inc / "cuda" / "CUDAAllocatorConfig.h").write_text(
        f"class C10_CUDA_API CUDAAllocatorConfig {{\n public:\n{config}}};\n"
    )
    return torch


# ---- reading the headers ----
def test_the_virtual_methods_and_which_are_pure():
    found = torch_interface.class_virtuals(CUDA_ALLOCATOR_212, "CUDAAllocator")
    assert found["raw_alloc"] is True and found["recordHistory"] is True  # several lines
    assert found["getMemoryFraction"] is False and found["getUserMetadata"] is False
    assert found["attachOomRejectionObserver"] is True
    assert found["allocateWithAddress"] is False  # a default that throws: nothing to build
    assert "commentedOut" not in found and "alsoCommentedOut" not in found
    base = torch_interface.class_virtuals(ALLOCATOR, "Allocator")
    assert base == {"allocate": True, "raw_deleter": False, "copy_data": True}  # no destructor
    assert torch_interface.class_virtuals(ALLOCATOR, "CUDAAllocator") == {}


def test_the_sources_overrides_cover_every_pure_virtual_of_torch_2_11():
    done = torch_interface.implemented(torch_interface.SOURCE.read_text())
    for text, cls in ((CUDA_ALLOCATOR_211, "CUDAAllocator"), (ALLOCATOR, "Allocator")):
        pure = {m for m, p in torch_interface.class_virtuals(text, cls).items() if p}
        assert pure <= done, pure - done
    # what 2.12 added is implemented, under its define
    assert "attachOomRejectionObserver" in done
    assert "attachOomRejectionObserver" in torch_interface.guarded(
        torch_interface.SOURCE.read_text()
    )


def test_torch_2_11_builds_without_defines_and_2_12_with_its_additions(tmp_path):
    old = torch_interface.read(
        fake_torch(tmp_path / "a", "2.11.0+cu130", CUDA_ALLOCATOR_211, rejections=False)
    )
    assert old.version == "2.11.0+cu130" and old.problem() == ""
    assert old.defines == [] and old.flags() == []
    new = torch_interface.read(
        fake_torch(tmp_path / "b", "2.15.0+cu132", CUDA_ALLOCATOR_212, rejections=True)
    )
    assert new.problem() == "" and new.unknown == []
    assert new.flags() == [
        "-DBRIDGE_TORCH_HAS_attachOomRejectionObserver",
        "-DBRIDGE_TORCH_HAS_num_oom_rejections",
        "-DBRIDGE_TORCH_HAS_throw_on_cudamalloc_oom",
    ]


def test_a_pure_virtual_the_bridge_does_not_know_is_named_with_the_torch_version(tmp_path):
    future = CUDA_ALLOCATOR_212.replace(
        _ATTACH, _ATTACH + "  virtual void frobnicatePools(c10::DeviceIndex device) = 0;\n"
    )
    iface = torch_interface.read(fake_torch(tmp_path, "2.16.0+cu132", future, rejections=True))
    assert iface.unknown == ["frobnicatePools"]
    problem = iface.problem()
    assert "torch 2.16.0+cu132's CUDAAllocator" in problem
    assert "frobnicatePools" in problem and "torch<2.16" in problem


def test_a_torch_without_headers_says_so(tmp_path):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "version.py").write_text("__version__ = '2.15.0+cpu'\n")
    iface = torch_interface.read(tmp_path / "torch")
    assert iface.include is None and "torch 2.15.0+cpu has no C++ headers" in iface.problem()


def test_the_installed_torchs_interface_needs_nothing_the_bridge_lacks():
    root = torch_interface.torch_root()
    if root is None or not (root / "include").is_dir():
        pytest.skip("no torch with its headers here")
    iface = torch_interface.read(root)
    assert iface.problem() == "", iface.problem()
    has = iface.virtuals.get("attachOomRejectionObserver") is not None
    assert ("BRIDGE_TORCH_HAS_attachOomRejectionObserver" in iface.defines) == has


def test_the_tested_range_is_the_one_pyproject_allows():
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    low, high = torch_interface.TESTED
    wanted = f'"torch>={low},<{torch_interface._next_minor(high)}"'
    torches = [line for line in text.splitlines() if re.search(r'"torch[<>=]', line)]
    assert torches and all(wanted in line for line in torches), torches


# ---- the build's failure words ----
NINJA_OUTPUT = """Error building extension 'bridge_torch_0123': [1/3] c++ -MMD -O2 -c a.cpp
FAILED: _torch_allocator.o
c++ -MMD -MF _torch_allocator.o.d -DTORCH_EXTENSION_NAME=bridge_torch_0123 -Werror=x -c
In file included from /site/torch/include/c10/cuda/CUDACachingAllocator.h:3,
/home/u/src/adapters/_torch_allocator.cpp:210:9: error: 'OomRejectionObserver' is not a member
/home/u/src/adapters/_torch_allocator.cpp:214:1: error: expected '}' at end of input
ninja: build stopped: subcommand failed.
"""


def test_the_first_compiler_error_is_the_reason_not_ninjas_last_line():
    assert native_build.first_error(NINJA_OUTPUT) == (
        "_torch_allocator.cpp:210:9: error: 'OomRejectionObserver' is not a member"
    )
    linker = "c++ x.o -o m.so\n/usr/bin/ld: cannot find -lc10_cuda\ncollect2: error: ld returned 1"
    assert native_build.first_error(linker) == "/usr/bin/ld: cannot find -lc10_cuda"
    assert native_build.first_error("something else\nwent wrong\n") == "went wrong"


def test_a_failed_build_names_torch_and_the_first_error_and_doctor_says_it(tmp_path, monkeypatch):
    root = fake_torch(tmp_path / "site", "2.15.0+cu132", CUDA_ALLOCATOR_212, rejections=True)
    extension = types.ModuleType("torch.utils.cpp_extension")

    def load(**kwargs):  # what torch's builder raises when ninja fails
        assert "-DBRIDGE_TORCH_HAS_attachOomRejectionObserver" in kwargs["extra_cflags"]
        (Path(kwargs["build_directory"]) / "half.o").write_text("")
        raise RuntimeError(NINJA_OUTPUT)

    extension.load = load  # type: ignore[attr-defined]
    torch = types.ModuleType("torch")
    torch.__file__ = str(root / "__init__.py")
    torch.__version__ = "2.15.0+cu132"  # type: ignore[attr-defined]
    torch.version = types.SimpleNamespace(cuda="13.2")  # type: ignore[attr-defined]
    torch._C = types.SimpleNamespace(_GLIBCXX_USE_CXX11_ABI=1)  # type: ignore[attr-defined]
    utils = types.ModuleType("torch.utils")
    utils.cpp_extension = extension  # type: ignore[attr-defined]
    torch.utils = utils  # type: ignore[attr-defined]
    for name, module in (("torch", torch), ("torch.utils", utils)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, "torch.utils.cpp_extension", extension)
    monkeypatch.setenv("BRIDGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(torch_build.PLUGGABLE_ENV, raising=False)
    monkeypatch.setattr(torch_build, "missing_tools", lambda: "")
    assert torch_build.describe()[0] == "ok"

    assert torch_build.load() is None
    assert torch_build.reason == (
        "building it for torch 2.15.0+cu132 failed: _torch_allocator.cpp:210:9: error: "
        "'OomRejectionObserver' is not a member"
    )
    assert torch_build.cached_builds() == []  # no half-built module is kept
    level, text = torch_build.describe()
    assert level == "warn" and text.startswith(
        "torch 2.15.0+cu132 would run on torch's CUDAPluggableAllocator, because the bridge's "
        "torch allocator cannot be built for it here: the last try: building it for torch "
        "2.15.0+cu132 failed: _torch_allocator.cpp:210:9"
    )
    out = io.StringIO()
    assert main(["build-torch"], stdout=out) == 1
    said = out.getvalue()
    assert "is not available: building it for torch 2.15.0+cu132 failed: " in said
    assert "error: 'OomRejectionObserver' is not a member" in said


def test_build_torch_refuses_a_torch_with_a_pure_virtual_it_does_not_know(tmp_path, monkeypatch):
    future = CUDA_ALLOCATOR_212.replace(
        _ATTACH, _ATTACH + "  virtual void frobnicatePools(c10::DeviceIndex device) = 0;\n"
    )
    root = fake_torch(tmp_path / "site", "2.16.0+cu132", future, rejections=True)
    torch = types.ModuleType("torch")
    torch.__file__ = str(root / "__init__.py")
    torch.__version__ = "2.16.0+cu132"  # type: ignore[attr-defined]
    torch.version = types.SimpleNamespace(cuda="13.2")  # type: ignore[attr-defined]
    torch._C = types.SimpleNamespace()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setenv("BRIDGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(torch_build.PLUGGABLE_ENV, raising=False)
    monkeypatch.setattr(torch_build, "missing_tools", lambda: "")
    assert torch_build.load() is None  # no compiler ran: torch.utils is not even there
    assert "frobnicatePools" in torch_build.reason and "torch 2.16.0+cu132" in torch_build.reason
    level, text = torch_build.describe()
    assert level == "warn" and "frobnicatePools" in text and "CUDAPluggableAllocator" in text


def test_build_torch_without_torch_says_what_to_install_without_a_traceback():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # no torch in this Python
        from bridge.tools.cli import main
        sys.exit(main(["build-torch"]))
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert r.stdout.startswith("torch is not installed in this Python (")
    assert "pip install torch" in r.stdout and "then run build-torch again" in r.stdout
