/*
 * module.c -- heterospec._C, the CPython binding of the C core: its method table and init.
 *
 * The functions live by op family (call.h says which file holds what); the Python API over them, which adds
 * the defaults, the allocators and the streams, is heterospec/ops.py.
 */
#define HS_NUMPY_API_HOME /* this file imports the NumPy C API for all of the binding */
#include "call.h"

#define HS_FAST(f) ((PyCFunction)(void (*)(void))(f)), METH_FASTCALL

static PyMethodDef hs_methods[] = {
    {"topk_entropy", HS_FAST(py_topk_entropy), "topk_entropy(logits, k, temperature, alloc, stream, check, batched)"},
    {"expand", HS_FAST(py_expand),
     "expand(logits, beam_scores, beam_nodes, k, d2t, node_offset, alloc, stream, check, batched)"},
    {"select", HS_FAST(py_select), "select(scores, n, m, width, alloc, stream, check, batched)"},
    {"build_tree", HS_FAST(py_build_tree),
     "build_tree(tokens, parents, selected, root_token, n, alloc, stream, check, device_outputs, batched)"},
    {"verify_greedy", HS_FAST(py_verify_greedy),
     "verify_greedy(tree_tokens, tree_parents, target_logits, n, alloc, stream, check, device_outputs, batched)"},
    {"verify_sample", HS_FAST(py_verify_sample),
     "verify_sample(tree_tokens, tree_parents, target_logits, n, temperature, top_k, top_p, seed, offset, alloc, "
     "stream, check, device_outputs, advance_offset, batched)"},
    {"kv_compact", HS_FAST(py_kv_compact),
     "kv_compact(tensors or KVTensors, prefix_len, slots, stream, check, batched)"},
    {"bucketize", HS_FAST(py_bucketize), "bucketize(values, thresholds, alloc, stream, check) -> out"},
    {"philox4x32", py_philox4x32, METH_VARARGS, "philox4x32(c0, c1, c2, c3, k0, k1) -> 4 words"},
    {"philox_uniform", py_philox_uniform, METH_VARARGS, "philox_uniform(n, seed, offset, alloc) -> out"},
    {"build_info", py_build_info, METH_NOARGS, "what this extension was compiled with"},
    {"cuda_check", py_cuda_check, METH_VARARGS, "cuda_check(device, stream): sync and raise recorded device errors"},
    {"cuda_reserve", py_cuda_reserve, METH_VARARGS, "cuda_reserve(device, bytes): grow the CUDA workspace now"},
    {"cuda_new_stream", py_cuda_new_stream, METH_VARARGS,
     "cuda_new_stream(device) -> a new non-blocking cudaStream_t (int) that heterospec never destroys"},
    {"cuda_chunks", py_cuda_chunks, METH_VARARGS, "cuda_chunks(rows, V): chunks per row of the split-row kernels"},
    {"cuda_set_chunk_min", py_cuda_set_chunk_min, METH_VARARGS,
     "cuda_set_chunk_min(n): fewest entries of a split-row chunk from now on (0: the default); returns the old value"},
    {"_emu_blocks", py_emu_blocks, METH_NOARGS,
     "_emu_blocks() -> kernel blocks the emulated CUDA build has run since it loaded; None in other builds (for tests)"},
    {"_set_release_gil", py_set_release_gil, METH_O,
     "_set_release_gil(flag) -> the previous setting: whether core calls release the GIL (default True; for tests)"},
    {NULL, NULL, 0, NULL},
};

static int hs_exec(PyObject *module) {
    if (PyArray_ImportNumPyAPI() < 0) return -1;
    if (hs_cuda_error_type == NULL) {
        hs_cuda_error_type = PyErr_NewExceptionWithDoc("heterospec._C.CudaError",
                                                       "A CUDA runtime call or kernel launch failed.", PyExc_RuntimeError, NULL);
        if (hs_cuda_error_type == NULL) return -1;
    }
    Py_INCREF(hs_cuda_error_type);
    if (PyModule_AddObject(module, "CudaError", hs_cuda_error_type) < 0) {
        Py_DECREF(hs_cuda_error_type);
        return -1;
    }
    return hs_kv_add_type(module);
}

static PyModuleDef_Slot hs_slots[] = {
    {Py_mod_exec, hs_exec},
#ifdef Py_mod_multiple_interpreters
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
    {0, NULL},
};

static struct PyModuleDef hs_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "heterospec._C",
    .m_doc = "C core of heterospec (see heterospec.ops for the documented API).",
    .m_size = 0,
    .m_methods = hs_methods,
    .m_slots = hs_slots,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&hs_module); }
