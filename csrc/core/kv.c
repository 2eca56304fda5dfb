/*
 * kv.c -- KV-cache compaction after acceptance.
 *
 * The verification forward appends the keys and values of all tree nodes after the committed prefix;
 * only the accepted path's slots survive.  Moving slot prefix_len + slots[i] to prefix_len + i for
 * ascending slots with slots[i] >= i is safe in place when done in increasing i: every destination
 * prefix_len + i is at or before its source and after every source still to be read.
 *
 * A slot list may be padded with -1 (the padded path of verify_*(device_outputs=True)): entries from the
 * first -1 on are ignored, and must all be -1.
 */
#include "common.h"

/* Number of entries of slots[base .. base + mb) before the first -1 (padding). */
static int64_t hs_kv_count(const void *slots, hs_dtype dt, int64_t base, int64_t mb) {
    int64_t i = 0;
    while (i < mb && hs_load_id(slots, dt, base + i) != -1) i++;
    return i;
}

hs_status hs_kv_compact_check(int64_t batch, int64_t S, const int64_t *prefix_len, const void *slots,
                              hs_dtype slot_dtype, int64_t SM, const int64_t *m, hs_error *err) {
    static const char op[] = "kv_compact";
    if (!hs_is_id_dtype(slot_dtype))
        return hs_fail(err, HS_ERR_DTYPE, op, "slots", "expected int32 or int64, got %s", hs_dtype_name(slot_dtype));
    if (S < 0)
        return hs_fail(err, HS_ERR_VALUE, op, "tensors", "expected S >= 0, got %lld", (long long)S);
    for (int64_t b = 0; b < batch; b++) {
        int64_t mb = m[b], P = prefix_len[b];
        if (P < 0)
            return hs_fail(err, HS_ERR_VALUE, op, "prefix_len", "expected >= 0, got %lld", (long long)P);
        if (mb < 0 || mb > SM)
            return hs_fail(err, HS_ERR_VALUE, op, "slots", "expected a count in [0, %lld], got %lld", (long long)SM,
                           (long long)mb);
        const int64_t base = b * SM, valid = hs_kv_count(slots, slot_dtype, base, mb);
        for (int64_t i = valid + 1; i < mb; i++) {
            int64_t s = hs_load_id(slots, slot_dtype, base + i);
            if (s != -1)
                return hs_fail(err, HS_ERR_VALUE, op, "slots",
                               "expected only -1 (padding) after the first -1, got %lld at [%lld] after -1 at [%lld]",
                               (long long)s, (long long)i, (long long)valid);
        }
        for (int64_t i = 0; i < valid; i++) {
            int64_t s = hs_load_id(slots, slot_dtype, base + i);
            if (s < i)
                return hs_fail(err, HS_ERR_VALUE, op, "slots", "expected slots[i] >= i, got slots[%lld] = %lld",
                               (long long)i, (long long)s);
            if (i > 0 && s <= hs_load_id(slots, slot_dtype, base + i - 1))
                return hs_fail(err, HS_ERR_VALUE, op, "slots",
                               "expected strictly ascending slots, got %lld at [%lld] after %lld", (long long)s,
                               (long long)i, (long long)hs_load_id(slots, slot_dtype, base + i - 1));
            /* P + s >= S without overflow (0 <= P, 0 <= S); S = INT64_MAX is the binding's "no tensors", which bound
             * nothing (docs/ops.md: the bound holds for every tensor) */
            if (S != INT64_MAX && s >= S - P)
                return hs_fail(err, HS_ERR_VALUE, op, "slots",
                               "expected prefix_len + slot < S = %lld, got %lld + %lld at [%lld]", (long long)S,
                               (long long)P, (long long)s, (long long)i);
        }
    }
    return HS_OK;
}

hs_status hs_kv_compact(void *data, int64_t batch, int64_t inner, int64_t S, int64_t row_bytes,
                        const int64_t *prefix_len, const void *slots, hs_dtype slot_dtype, int64_t SM,
                        const int64_t *m, hs_error *err) {
    hs_status st = hs_kv_compact_check(batch, S, prefix_len, slots, slot_dtype, SM, m, err);
    if (st != HS_OK) return st;
    if (inner < 0 || row_bytes < 0)
        return hs_fail(err, HS_ERR_VALUE, "kv_compact", "tensors", "expected non-negative sizes, got inner %lld, row %lld bytes",
                       (long long)inner, (long long)row_bytes);
    /* a tensor with no elements per row (D = 0) has nothing to move, and may have no memory at all (a NULL
     * data pointer: memcpy's arguments must not be NULL even for 0 bytes) */
    if (row_bytes == 0 || inner == 0 || data == NULL) return HS_OK;
    char *base = (char *)data;
    for (int64_t b = 0; b < batch; b++) {
        int64_t P = prefix_len[b], mb = hs_kv_count(slots, slot_dtype, b * SM, m[b]);
        for (int64_t h = 0; h < inner; h++) {
            char *seq = base + ((size_t)(b * inner + h) * (size_t)S) * (size_t)row_bytes;
            for (int64_t i = 0; i < mb; i++) {
                int64_t s = hs_load_id(slots, slot_dtype, b * SM + i);
                if (s == i) continue; /* already in place */
                memcpy(seq + (size_t)(P + i) * (size_t)row_bytes, seq + (size_t)(P + s) * (size_t)row_bytes,
                       (size_t)row_bytes);
            }
        }
    }
    return HS_OK;
}
