// The Python module of the compiled CPU kernels (worker/cpu_kernels.py builds it).
#include "kernels.h"

namespace py = pybind11;

// The attention kernels' arguments, named: FP8 pages come with their scales, which other
// pages go without.
#define PAGED_ARGS                                                                            \
  py::arg("out"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("rows"),      \
      py::arg("n_q"), py::arg("page_start"), py::arg("kv_lens"), py::arg("kv_indices"),       \
      py::arg("scale"), py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none()

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode,
        "paged decode attention, a few causal queries per sequence, read in place from the "
        "KV pages",
        PAGED_ARGS);
  m.def("paged_decode_items", &paged_decode_items,
        "paged_decode's work items: (split, the sequences that read it together)");
  m.def("paged_prefill", &paged_prefill,
        "paged prefill attention, causal behind a cached prefix, read in place from the KV "
        "pages",
        PAGED_ARGS);
  m.def("small_linear", &small_linear,
        "x @ w.T for a few rows of x (decode, speculative verify), reading w once");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, HF's rounding, one pass");
  m.def("add_rms_norm", &add_rms_norm, "residual += delta in place, then its RMSNorm");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a [rows, 2 * intermediate] gate_up");
  m.def("rope_store_kv", &rope_store_kv,
        "rotary of q and k from fused qkv rows, k and v stored at their KV slots (FP8 pages: "
        "quantized, with their scales); returns q",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("slots"), py::arg("num_heads"), py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none());
}
