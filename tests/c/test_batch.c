/*
 * test_batch.c -- the batch-first ABI of the C core, driven directly from C (Python drives batch 1).
 *
 * For every op with a batch dimension, a batch of requests with different per-row sizes must give, row
 * by row, exactly what a batch-1 call on that row gives; per-row sizes shorter than the padded width must
 * not read or write past their own row.  Built and run by tests/test_c_core.py; prints
 * "N passed, M failed" and exits non-zero on any failure.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hs/heterospec.h"

static int passed = 0, failed = 0;

#define CHECK(cond, ...)                                                                                       \
    do {                                                                                                       \
        if (cond) {                                                                                            \
            passed++;                                                                                          \
        } else {                                                                                               \
            failed++;                                                                                          \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                                                        \
            printf(__VA_ARGS__);                                                                               \
            printf("\n");                                                                                      \
        }                                                                                                      \
    } while (0)

static uint64_t rng_state = 88172645463325252ull;
static double urand(void) { /* xorshift64 */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) * (1.0 / 9007199254740992.0);
}
static float nrand(void) { return (float)(sqrt(-2.0 * log(urand() + 1e-12)) * cos(6.283185307179586 * urand())); }

static void test_verify(void) {
    enum { B = 3, T = 6, V = 37 };
    /* three trees padded to T nodes: 6, 3 and 1 nodes */
    int64_t tokens[B][T] = {{0, 4, 9, 4, 2, 7}, {5, 1, 3, 0, 0, 0}, {8, 0, 0, 0, 0, 0}};
    int64_t parents[B][T] = {{-1, 0, 0, 1, 3, 1}, {-1, 0, 1, 0, 0, 0}, {-1, 0, 0, 0, 0, 0}};
    int64_t n[B] = {6, 3, 1};
    static float logits[B][T][V];
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int v = 0; v < V; v++) logits[b][t][v] = nrand();
    /* make greedy walk into the trees: row 0 accepts 4 then 4 then 2; row 1 accepts 1 then 3 */
    logits[0][0][4] = 9.f, logits[0][1][4] = 9.f, logits[0][3][2] = 9.f;
    logits[1][0][1] = 9.f, logits[1][1][3] = 9.f;

    int64_t path[B][T], len[B], next[B];
    hs_error err;
    hs_status st = hs_verify_greedy(tokens, HS_INT64, parents, HS_INT64, B, T, n, logits, HS_FLOAT32, V,
                                    &path[0][0], len, next, &err);
    CHECK(st == HS_OK, "batched verify_greedy failed: %s", err.msg);
    CHECK(len[0] == 4 && path[0][1] == 1 && path[0][2] == 3 && path[0][3] == 4, "row 0 path, len %lld",
          (long long)len[0]);
    CHECK(len[1] == 3 && path[1][1] == 1 && path[1][2] == 2, "row 1 path, len %lld", (long long)len[1]);
    CHECK(len[2] == 1, "row 2 (root only) len %lld", (long long)len[2]);
    for (int b = 0; b < B; b++) {
        int64_t p1[T], l1, n1;
        st = hs_verify_greedy(tokens[b], HS_INT64, parents[b], HS_INT64, 1, T, &n[b], logits[b], HS_FLOAT32, V, p1,
                              &l1, &n1, &err);
        CHECK(st == HS_OK && l1 == len[b] && n1 == next[b] && memcmp(p1, path[b], (size_t)l1 * 8) == 0,
              "verify_greedy row %d differs from its batch-1 call", b);
    }

    hs_sampling sp = {0.8, 5, 0.9, 0.1};
    uint64_t seeds[B] = {11, 12, 13}, offsets[B] = {0, 100, 7};
    int64_t draws[B];
    size_t wsb = hs_verify_sample_workspace_bytes(T, V);
    void *ws = malloc(wsb);
    st = hs_verify_sample(tokens, HS_INT64, parents, HS_INT64, B, T, n, logits, HS_FLOAT32, V, sp, seeds, offsets,
                          &path[0][0], len, next, draws, ws, wsb, &err);
    CHECK(st == HS_OK, "batched verify_sample failed: %s", err.msg);
    for (int b = 0; b < B; b++) {
        int64_t p1[T], l1, n1, d1;
        st = hs_verify_sample(tokens[b], HS_INT64, parents[b], HS_INT64, 1, T, &n[b], logits[b], HS_FLOAT32, V, sp,
                              &seeds[b], &offsets[b], p1, &l1, &n1, &d1, ws, wsb, &err);
        CHECK(st == HS_OK && l1 == len[b] && n1 == next[b] && d1 == draws[b] &&
                  memcmp(p1, path[b], (size_t)l1 * 8) == 0,
              "verify_sample row %d differs from its batch-1 call", b);
    }
    /* a bad tree in row 1 is reported, naming the argument */
    parents[1][2] = 2;
    st = hs_verify_greedy(tokens, HS_INT64, parents, HS_INT64, B, T, n, logits, HS_FLOAT32, V, &path[0][0], len, next,
                          &err);
    CHECK(st == HS_ERR_VALUE && strstr(err.msg, "argument 'tree_parents'") != NULL, "bad row 1 tree: %s", err.msg);
    free(ws);
}

static void test_select_and_tree(void) {
    enum { B = 2, M = 6, N = 3 };
    float scores[B][M] = {{-1.f, -0.5f, -3.f, -0.5f, -2.f, -9.f}, {-4.f, -1.f, -2.f, 0.f, 0.f, 0.f}};
    int64_t m[B] = {6, 3}, n[B] = {3, 2}, out[B][N];
    size_t wsb = hs_select_workspace_bytes(M);
    void *ws = malloc(wsb);
    hs_error err;
    hs_status st = hs_select(scores, HS_FLOAT32, B, M, m, n, N, &out[0][0], ws, wsb, &err);
    CHECK(st == HS_OK, "batched select failed: %s", err.msg);
    /* row 0: best three are 1 (-0.5), 3 (-0.5), 0 (-1); row 1 sees only its first 3 entries: 1, 2 */
    CHECK(out[0][0] == 0 && out[0][1] == 1 && out[0][2] == 3, "select row 0: %lld %lld %lld", (long long)out[0][0],
          (long long)out[0][1], (long long)out[0][2]);
    CHECK(out[1][0] == 1 && out[1][1] == 2, "select row 1 ignores entries past m: %lld %lld", (long long)out[1][0],
          (long long)out[1][1]);
    free(ws);

    /* trees from candidate lists: row 0 selects 3 of 6 candidates, row 1 selects 1 */
    int64_t tok[B][M] = {{10, 11, 12, 13, 14, 15}, {20, 21, 22, 23, 24, 25}};
    int64_t par[B][M] = {{-1, -1, 0, 2, 1, -1}, {-1, 0, 1, -1, -1, -1}};
    int64_t sel[B][N] = {{0, 2, 3}, {3, 0, 0}}, nsel[B] = {3, 1}, roots[B] = {1, 2};
    int64_t otok[B][N + 1], opar[B][N + 1], odep[B][N + 1], leaves[B], depth[B];
    uint8_t mask[B][N + 1][N + 1];
    memset(mask, 7, sizeof mask);
    wsb = hs_build_tree_workspace_bytes(M);
    ws = malloc(wsb);
    st = hs_build_tree(tok, HS_INT64, par, HS_INT64, B, M, sel, HS_INT64, N, nsel, roots, &otok[0][0], &opar[0][0],
                       &odep[0][0], &mask[0][0][0], leaves, depth, ws, wsb, &err);
    CHECK(st == HS_OK, "batched build_tree failed: %s", err.msg);
    CHECK(otok[0][0] == 1 && otok[0][1] == 10 && otok[0][2] == 12 && otok[0][3] == 13, "row 0 tokens");
    CHECK(opar[0][1] == 0 && opar[0][2] == 1 && opar[0][3] == 2, "row 0 parents");
    CHECK(leaves[0] == 1 && depth[0] == 3, "row 0: a chain of 3 (leaves %lld depth %lld)", (long long)leaves[0],
          (long long)depth[0]);
    CHECK(mask[0][3][0] && mask[0][3][1] && mask[0][3][2] && mask[0][3][3], "row 0 last node sees its ancestors");
    CHECK(otok[1][0] == 2 && otok[1][1] == 23 && opar[1][1] == 0 && leaves[1] == 1 && depth[1] == 1, "row 1 tree");
    CHECK(mask[1][1][0] == 1 && mask[1][1][1] == 1 && mask[1][0][1] == 0, "row 1 mask");
    free(ws);

    int64_t T[B] = {4, 2}, retr[B][2][4];
    wsb = hs_tree_retrieve_workspace_bytes(N + 1);
    ws = malloc(wsb);
    st = hs_tree_retrieve(&opar[0][0], &odep[0][0], B, N + 1, T, 2, 4, &retr[0][0][0], ws, wsb, &err);
    CHECK(st == HS_OK, "batched retrieve failed: %s", err.msg);
    CHECK(retr[0][0][0] == 0 && retr[0][0][3] == 3 && retr[0][1][0] == -1, "row 0 retrieve");
    CHECK(retr[1][0][0] == 0 && retr[1][0][1] == 1 && retr[1][0][2] == -1, "row 1 retrieve");
    free(ws);

    /* a non-parent-closed selection in row 1 */
    int64_t bad[B][N] = {{0, 2, 3}, {1, 0, 0}};
    ws = malloc(hs_build_tree_workspace_bytes(M));
    st = hs_build_tree(tok, HS_INT64, par, HS_INT64, B, M, bad, HS_INT64, N, nsel, roots, &otok[0][0], &opar[0][0],
                       &odep[0][0], &mask[0][0][0], leaves, depth, ws, hs_build_tree_workspace_bytes(M), &err);
    CHECK(st == HS_ERR_VALUE && strstr(err.msg, "parent-closed") != NULL, "row 1 not parent-closed: %s", err.msg);
    free(ws);
}

static void test_expand(void) {
    enum { BATCH = 2, B = 3, VD = 50, K = 4 };
    static float logits[BATCH][B][VD];
    for (int i = 0; i < BATCH; i++)
        for (int b = 0; b < B; b++)
            for (int v = 0; v < VD; v++) logits[i][b][v] = nrand();
    float bs[BATCH][B] = {{0.f, -1.f, -2.f}, {-0.5f, -0.25f, -3.f}};
    int64_t bn[BATCH][B] = {{3, 5, 7}, {0, 1, 2}};
    int64_t tok[BATCH][B * K], par[BATCH][B * K], nb[BATCH][K];
    float sc[BATCH][B * K], ent[BATCH][B];
    size_t wsb = hs_expand_workspace_bytes(B, K, VD);
    void *ws = malloc(wsb);
    hs_error err;
    hs_status st = hs_expand(logits, HS_FLOAT32, BATCH, B, VD, bs, HS_FLOAT32, bn, HS_INT64, K, NULL, HS_INT64, 40,
                             &tok[0][0], &sc[0][0], &par[0][0], &ent[0][0], &nb[0][0], ws, wsb, &err);
    CHECK(st == HS_OK, "batched expand failed: %s", err.msg);
    for (int i = 0; i < BATCH; i++) {
        int64_t t1[B * K], p1[B * K], n1[K];
        float s1[B * K], e1[B];
        st = hs_expand(logits[i], HS_FLOAT32, 1, B, VD, bs[i], HS_FLOAT32, bn[i], HS_INT64, K, NULL, HS_INT64, 40, t1,
                       s1, p1, e1, n1, ws, wsb, &err);
        CHECK(st == HS_OK && memcmp(t1, tok[i], sizeof t1) == 0 && memcmp(s1, sc[i], sizeof s1) == 0 &&
                  memcmp(p1, par[i], sizeof p1) == 0 && memcmp(e1, ent[i], sizeof e1) == 0 &&
                  memcmp(n1, nb[i], sizeof n1) == 0,
              "expand request %d differs from its batch-1 call", i);
    }
    free(ws);
}

static void test_kv(void) {
    enum { BATCH = 2, INNER = 3, S = 10, D = 2, SM = 3 };
    static float kv[BATCH][INNER][S][D], want[BATCH][INNER][S][D];
    for (int i = 0; i < BATCH * INNER * S * D; i++) (&kv[0][0][0][0])[i] = (float)i;
    memcpy(want, kv, sizeof kv);
    int64_t prefix[BATCH] = {2, 5}, slots[BATCH][SM] = {{0, 3, 6}, {1, 4, 0}}, m[BATCH] = {3, 2};
    for (int b = 0; b < BATCH; b++)
        for (int h = 0; h < INNER; h++)
            for (int i = 0; i < m[b]; i++)
                for (int d = 0; d < D; d++) want[b][h][prefix[b] + i][d] = kv[b][h][prefix[b] + slots[b][i]][d];
    hs_error err;
    hs_status st = hs_kv_compact(kv, BATCH, INNER, S, D * (int64_t)sizeof(float), prefix, slots, HS_INT64, SM, m, &err);
    CHECK(st == HS_OK, "batched kv_compact failed: %s", err.msg);
    CHECK(memcmp(kv, want, sizeof kv) == 0, "batched kv_compact moved the wrong rows");
    int64_t late[BATCH][SM] = {{0, 3, 6}, {1, 5, 0}}; /* row 1: prefix 5 + slot 5 = 10 >= S */
    st = hs_kv_compact(kv, BATCH, INNER, S, D * (int64_t)sizeof(float), prefix, late, HS_INT64, SM, m, &err);
    CHECK(st == HS_ERR_VALUE && strstr(err.msg, "argument 'slots'") != NULL, "slot past S in row 1: %s", err.msg);
}

int main(void) {
    test_verify();
    test_select_and_tree();
    test_expand();
    test_kv();
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
