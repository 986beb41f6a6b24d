// The Python module of the compiled CPU kernels (worker/cpu_kernels.py builds it).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode,
        "paged decode attention, a few causal queries per sequence, read in place from the "
        "KV pages");
  m.def("small_linear", &small_linear,
        "x @ w.T for a few rows of x (decode, speculative verify), reading w once");
}
