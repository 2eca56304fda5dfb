/*
 * dlpack.h -- the DLPack ABI (v1.x), declared here from the public specification
 * (dmlc/dlpack include/dlpack/dlpack.h, docs/source/python_spec.rst) so that the binding needs no
 * third-party header.  Only what a consumer needs: devices, dtypes, the tensor and both managed forms.
 */
#ifndef HS_PY_DLPACK_H
#define HS_PY_DLPACK_H

#include <stdint.h>

enum {
    HS_DL_CPU = 1,
    HS_DL_CUDA = 2,
    HS_DL_CUDA_HOST = 3,
    HS_DL_ROCM = 10,
    HS_DL_CUDA_MANAGED = 13,
};

enum {
    HS_DL_INT = 0,
    HS_DL_UINT = 1,
    HS_DL_FLOAT = 2,
    HS_DL_BFLOAT = 4,
    HS_DL_COMPLEX = 5,
    HS_DL_BOOL = 6,
};

#define HS_DL_FLAG_READ_ONLY (1ULL << 0)

typedef struct {
    int32_t device_type;
    int32_t device_id;
} HSDLDevice;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} HSDLDataType;

typedef struct {
    void *data;
    HSDLDevice device;
    int32_t ndim;
    HSDLDataType dtype;
    int64_t *shape;
    int64_t *strides; /* in elements; NULL means compact row-major */
    uint64_t byte_offset;
} HSDLTensor;

typedef struct HSDLManagedTensor {
    HSDLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct HSDLManagedTensor *self);
} HSDLManagedTensor;

typedef struct {
    uint32_t major;
    uint32_t minor;
} HSDLPackVersion;

typedef struct HSDLManagedTensorVersioned {
    HSDLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct HSDLManagedTensorVersioned *self);
    uint64_t flags;
    HSDLTensor dl_tensor;
} HSDLManagedTensorVersioned;

#endif /* HS_PY_DLPACK_H */
