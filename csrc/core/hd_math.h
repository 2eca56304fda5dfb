/*
 * hd_math.h -- arithmetic that the CPU core and the CUDA kernels must do bit for bit the same way:
 * float16/bfloat16 -> float32 conversion, the float64 exp behind verify_sample's weights,
 * Philox4x32-10 and bucketize's threshold search.  Compiled as C11 by the CPU core and as CUDA C++ (host and device) by csrc/cuda/; both
 * sides evaluate these expressions without FMA contraction (gcc -std=c11 keeps -ffp-contract=off, the CUDA
 * sources are built with -fmad=false), so the same inputs give the same doubles and the same uniforms, and
 * CPU and GPU walk a sampled tree along the same path.
 */
#ifndef HS_CORE_HD_MATH_H
#define HS_CORE_HD_MATH_H

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define HS_HD __host__ __device__ __forceinline__
#elif defined(HS_CUDA_EMU)
#define HS_HD inline
#else
#define HS_HD static inline
#endif

HS_HD float hs_bits_to_float(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

HS_HD float hs_half_to_float(uint16_t h) {
    /* IEEE binary16 -> binary32 by bit manipulation (exact for every value, subnormals included). */
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0x1f) return hs_bits_to_float(sign | 0x7f800000u | (mant << 13)); /* Inf / NaN */
    if (exp != 0) return hs_bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
    if (mant == 0) return hs_bits_to_float(sign);
    float f = (float)mant * 5.9604644775390625e-08f; /* subnormal: mant * 2^-24 (exact) */
    return sign ? -f : f;
}

HS_HD float hs_bf16_to_float(uint16_t h) { return hs_bits_to_float((uint32_t)h << 16); }

/* exp(x) for x <= 0 in float64, branch-free so the CPU loop vectorises: x = n ln2 + r with |r| <= ln2/2,
 * e^r by its Taylor polynomial to degree 12 (truncation < 2e-16 relative), 2^n from the exponent bits.
 * Below -708 the result is 0 (exp(-708) < 1e-307 next to a largest term of 1), as docs/ops.md says. */
HS_HD double hs_exp_nonpos_f64(double x) {
    const double shifter = 6755399441055744.0; /* 1.5 * 2^52: x + shifter rounds x to an integer */
    /* x within [-708, 0] for the int32 conversion of n below (NaN too, whose result is NaN: no undefined
     * conversion even outside the contract) */
    double xc = x >= -708.0 ? (x <= 0.0 ? x : 0.0) : -708.0;
    double n = (xc * 1.4426950408889634 + shifter) - shifter;
    double r = (xc - n * 6.93147180369123816490e-01) - n * 1.90821492927058770002e-10; /* fdlibm ln2 hi/lo */
    double p = 2.08767569878680989792e-09;                                             /* 1/12! */
    p = p * r + 2.50521083854417187751e-08;                                            /* 1/11! */
    p = p * r + 2.75573192239858906526e-07;                                            /* 1/10! */
    p = p * r + 2.75573192239858906526e-06;                                            /* 1/9! */
    p = p * r + 2.48015873015873015873e-05;                                            /* 1/8! */
    p = p * r + 1.98412698412698412698e-04;                                            /* 1/7! */
    p = p * r + 1.38888888888888888889e-03;                                            /* 1/6! */
    p = p * r + 8.33333333333333333333e-03;                                            /* 1/5! */
    p = p * r + 4.16666666666666666667e-02;                                            /* 1/4! */
    p = p * r + 1.66666666666666666667e-01;                                            /* 1/3! */
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    /* via int32: there is no packed double->int64 conversion before AVX-512 */
    uint64_t bits = (uint64_t)(uint32_t)((int32_t)n + 1023) << 52;
    double scale;
    memcpy(&scale, &bits, sizeof scale);
    return x != x ? x : x < -708.0 ? 0.0 : p * scale;
}

/* Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): word 0 of the
 * bijection of counter (c_lo, c_hi, 0, 0) under key (seed_lo, seed_hi), times 2^-32. */
HS_HD void hs_philox_rounds(uint32_t c[4], uint32_t k0, uint32_t k1) {
    for (int round = 0; round < 10; round++) {
        if (round > 0) { /* Weyl key schedule */
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        uint64_t p0 = (uint64_t)0xD2511F53u * c[0], p1 = (uint64_t)0xCD9E8D57u * c[2];
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c[1] ^ k0, n1 = (uint32_t)p1;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c[3] ^ k1, n3 = (uint32_t)p0;
        c[0] = n0;
        c[1] = n1;
        c[2] = n2;
        c[3] = n3;
    }
}

HS_HD double hs_philox_u(uint64_t seed, uint64_t offset, uint64_t j) {
    uint64_t ctr = offset + j; /* wraps mod 2^64 by unsigned arithmetic */
    uint32_t c[4] = {(uint32_t)ctr, (uint32_t)(ctr >> 32), 0u, 0u};
    hs_philox_rounds(c, (uint32_t)seed, (uint32_t)(seed >> 32));
    return (double)c[0] * 2.3283064365386963e-10; /* 2^-32: exact, so u is in [0, 1) */
}

/* bucketize's search, shared so CPU and GPU agree on every boundary: the number of thresholds < x, for
 * ascending float32 (f64 = 0) or float64 (f64 = 1) thresholds[T]. */
HS_HD int64_t hs_count_below(double x, const void *thresholds, int f64, int64_t T) {
    int64_t lo = 0, hi = T;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        double t = f64 ? ((const double *)thresholds)[mid] : (double)((const float *)thresholds)[mid];
        if (x > t) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

#endif /* HS_CORE_HD_MATH_H */
