// The Python module of the CPU kernels (see cpu_kernels.h).
#include "cpu_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("gemv", &strata_cpu::gemv, "x @ W_i.T for GGUF blocks W_i and 1..8 rows of x, in one pass",
        py::arg("x"), py::arg("blocks"), py::arg("qtypes"), py::arg("K"));
  m.def("dequantize", &strata_cpu::dequantize, "GGUF blocks into a dense float32 or bfloat16 tensor");
  m.def("rms_norm", &strata_cpu::rms_norm, "RMSNorm, optionally then RoPE and a residual add", py::arg("x"),
        py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none(), py::arg("cos") = py::none(),
        py::arg("sin") = py::none());
  m.def("attention_decode", &strata_cpu::attention_decode, "one query's attention over float32 K/V slot runs",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("runs"), py::arg("scale"));
  m.attr("max_m") = strata_cpu::kMaxM;
}
