/*
 * kvpool.core._xxh3copy: copy a block and compute its xxh3-64 in one pass over the bytes.
 *
 * Why: a verified read (or a checksummed write) is a copy plus a checksum. Done as two
 * passes, or as two library calls on cache-hot pieces, the checksum costs as much again as
 * the copy on this kind of host (the xxhash wheel is an SSE2 build). Here every 64-byte
 * stripe is loaded into registers once, stored to the destination and folded into the
 * hash from the same registers, so the hash rides on the copy's memory traffic. The digest
 * is exactly XXH3_64bits(src, len) with the default secret and seed 0 (the "kvpool"
 * checksum, kvpool/core/checksum.py); tests/property/test_checksum_native.py compares it
 * with the xxhash package over many lengths and alignments.
 *
 * Only the long-input path of XXH3 (more than 240 bytes) is implemented: shorter blocks are
 * hashed by the xxhash package in the Python wrapper. The AVX2 kernel is picked at run time
 * when the CPU has it; otherwise a portable scalar kernel computes the same digest.
 *
 * The GIL is released while bytes move, so other threads of the client (or the daemon's
 * service threads verifying other commits) run meanwhile. The buffers stay alive for the
 * call: the Py_buffer views hold them.
 *
 * recv_rows (kvpool/transport/recv_rows.py) is the same one pass on the TCP receive path: the
 * kernel copies the bytes into the caller's rows and each 1,024-byte block is folded into its
 * row's digest right after it lands (feed_*), while still in cache. It lives here because it
 * shares the XXH3 kernels (hence this file's length past 600 lines).
 *
 * The algorithm follows the XXH3 specification (xxhash.com, doc/xxhash_spec.md): eight
 * 64-bit accumulators, 64-byte stripes, a scramble every 16 stripes (1,024 bytes), the last
 * stripe re-read from the end, then merged and avalanched.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KV_X86 1
#else
#define KV_X86 0
#endif

#define PRIME32_1 0x9E3779B1U
#define PRIME32_2 0x85EBCA77U
#define PRIME32_3 0xC2B2AE3DU
#define PRIME64_1 0x9E3779B185EBCA87ULL
#define PRIME64_2 0xC2B2AE3D27D4EB4FULL
#define PRIME64_3 0x165667B19E3779F9ULL
#define PRIME64_4 0x85EBCA77C2B2AE63ULL
#define PRIME64_5 0x27D4EB2F165667C5ULL

#define STRIPE_LEN 64
#define SECRET_SIZE 192
#define SECRET_CONSUME_RATE 8
#define STRIPES_PER_BLOCK ((SECRET_SIZE - STRIPE_LEN) / SECRET_CONSUME_RATE) /* 16 */
#define BLOCK_LEN (STRIPE_LEN * STRIPES_PER_BLOCK)                            /* 1024 */
#define SECRET_LASTACC_START 7
#define SECRET_MERGEACCS_START 11
/* Inputs of at most this many bytes take XXH3's short paths: the wrapper hashes them. */
#define MIDSIZE_MAX 240
/* How far ahead of the stripe being hashed its source is prefetched (xxHash uses 384; 1 KiB
 * measured best of 256 B - 2 KiB on the bench host). */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 1024
#endif

/* XXH3's default secret (kSecret), 192 bytes. */
static const uint8_t kSecret[SECRET_SIZE] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

static inline uint64_t read64(const void *p) {
    uint64_t v;
    memcpy(&v, p, sizeof v); /* little-endian hosts only: checked at import */
    return v;
}

static inline uint64_t mul128_fold64(uint64_t a, uint64_t b) {
    __uint128_t product = (__uint128_t)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
}

static inline uint64_t avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= 0x165667919E3779F9ULL;
    h ^= h >> 32;
    return h;
}

static uint64_t merge_accs(const uint64_t acc[8], uint64_t len) {
    const uint8_t *secret = kSecret + SECRET_MERGEACCS_START;
    uint64_t result = len * PRIME64_1;
    for (int i = 0; i < 4; i++) {
        result += mul128_fold64(acc[2 * i] ^ read64(secret + 16 * i), acc[2 * i + 1] ^ read64(secret + 16 * i + 8));
    }
    return avalanche(result);
}

static void init_accs(uint64_t acc[8]) {
    acc[0] = PRIME32_3;
    acc[1] = PRIME64_1;
    acc[2] = PRIME64_2;
    acc[3] = PRIME64_3;
    acc[4] = PRIME64_4;
    acc[5] = PRIME32_2;
    acc[6] = PRIME64_5;
    acc[7] = PRIME32_1;
}

/* ---- portable kernel ------------------------------------------------------------------ */

static inline void accumulate_512_scalar(uint64_t acc[8], const uint8_t *in, uint8_t *out, const uint8_t *secret) {
    uint64_t lanes[8];
    memcpy(lanes, in, STRIPE_LEN);
    /* the store and the hash below must use these loaded lanes: without the barrier a
     * compiler may copy straight from ``in`` and reload it for the hash, and a source that
     * changes meanwhile would give a digest of bytes that are not the ones stored */
    __asm__ volatile("" : "+m"(lanes));
    if (out != NULL) {
        memcpy(out, lanes, STRIPE_LEN);
    }
    for (int i = 0; i < 8; i++) {
        uint64_t data_key = lanes[i] ^ read64(secret + 8 * i);
        acc[i ^ 1] += lanes[i];
        acc[i] += (uint64_t)(uint32_t)data_key * (data_key >> 32);
    }
}

static inline void scramble_scalar(uint64_t acc[8], const uint8_t *secret) {
    for (int i = 0; i < 8; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= read64(secret + 8 * i);
        a *= PRIME32_1;
        acc[i] = a;
    }
}

/* Copy len bytes src -> dst (dst may be NULL: hash only) and return XXH3_64bits(src, len);
 * len > MIDSIZE_MAX. The last stripe is re-read from dst once copied (the bytes are
 * equal to what was loaded from src, so the digest is that of what dst holds). */
/* The 1,024-byte blocks of the input, each a scramble at its end (copied to dst unless NULL). */
static void blocks_scalar(uint64_t acc[8], const uint8_t *src, uint8_t *dst, size_t nb_blocks) {
    for (size_t n = 0; n < nb_blocks; n++) {
        const uint8_t *in = src + n * BLOCK_LEN;
        uint8_t *out = dst ? dst + n * BLOCK_LEN : NULL;
        for (size_t s = 0; s < STRIPES_PER_BLOCK; s++) {
            accumulate_512_scalar(acc, in + s * STRIPE_LEN, out ? out + s * STRIPE_LEN : NULL, kSecret + s * 8);
        }
        scramble_scalar(acc, kSecret + SECRET_SIZE - STRIPE_LEN);
    }
}

/* After the (len - 1) / BLOCK_LEN whole blocks: the stripes of the last partial block, the rest
 * copied to dst (unless NULL), the last stripe re-read from the end, merged. */
static uint64_t tail_scalar(uint64_t acc[8], const uint8_t *src, uint8_t *dst, size_t len) {
    size_t done = (len - 1) / BLOCK_LEN * BLOCK_LEN;
    size_t nb_stripes = ((len - 1) - done) / STRIPE_LEN;
    for (size_t s = 0; s < nb_stripes; s++) {
        accumulate_512_scalar(acc, src + done + s * STRIPE_LEN, dst ? dst + done + s * STRIPE_LEN : NULL, kSecret + s * 8);
    }
    done += nb_stripes * STRIPE_LEN;
    if (dst != NULL && done < len) {
        memcpy(dst + done, src + done, len - done);
    }
    const uint8_t *tail = (dst ? dst : src) + len - STRIPE_LEN;
    accumulate_512_scalar(acc, tail, NULL, kSecret + SECRET_SIZE - STRIPE_LEN - SECRET_LASTACC_START);
    return merge_accs(acc, (uint64_t)len);
}

static uint64_t hash_long_scalar(const uint8_t *src, uint8_t *dst, size_t len, int stream) {
    (void)stream; /* regular stores only */
    uint64_t acc[8];
    init_accs(acc);
    blocks_scalar(acc, src, dst, (len - 1) / BLOCK_LEN);
    return tail_scalar(acc, src, dst, len);
}

/* ---- AVX2 kernel ---------------------------------------------------------------------- */

#if KV_X86
/* One stripe: load, store to out (NULL: hash only; stream: non-temporal stores, out 32-byte
 * aligned), fold into the accumulators from the same registers. */
__attribute__((target("avx2"))) static inline void accumulate_512_avx2(__m256i acc[2], const uint8_t *in, uint8_t *out,
                                                                        const uint8_t *secret, int stream) {
    for (int i = 0; i < 2; i++) {
        __m256i data = _mm256_loadu_si256((const __m256i *)(in + 32 * i));
        if (out != NULL) {
            if (stream) {
                _mm256_stream_si256((__m256i *)(out + 32 * i), data);
            } else {
                _mm256_storeu_si256((__m256i *)(out + 32 * i), data);
            }
        }
        __m256i key = _mm256_loadu_si256((const __m256i *)(secret + 32 * i));
        __m256i data_key = _mm256_xor_si256(data, key);
        __m256i data_key_hi = _mm256_srli_epi64(data_key, 32);
        __m256i product = _mm256_mul_epu32(data_key, data_key_hi);
        __m256i data_swap = _mm256_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2));
        acc[i] = _mm256_add_epi64(acc[i], _mm256_add_epi64(product, data_swap));
    }
}

/* The 1,024-byte blocks of the input, each a scramble at its end; ``stream`` and ``out`` are
 * constants at each call below, so each variant compiles to its own tight loop. */
__attribute__((target("avx2"))) static inline void blocks_avx2(__m256i acc[2], const uint8_t *src, uint8_t *dst,
                                                                size_t nb_blocks, int stream);

__attribute__((target("avx2"))) static inline void scramble_avx2(__m256i acc[2], const uint8_t *secret) {
    const __m256i prime32 = _mm256_set1_epi32((int)PRIME32_1);
    for (int i = 0; i < 2; i++) {
        __m256i a = acc[i];
        a = _mm256_xor_si256(a, _mm256_srli_epi64(a, 47));
        a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i *)(secret + 32 * i)));
        __m256i a_hi = _mm256_shuffle_epi32(a, _MM_SHUFFLE(0, 3, 0, 1));
        __m256i prod_lo = _mm256_mul_epu32(a, prime32);
        __m256i prod_hi = _mm256_mul_epu32(a_hi, prime32);
        acc[i] = _mm256_add_epi64(prod_lo, _mm256_slli_epi64(prod_hi, 32));
    }
}

__attribute__((target("avx2"))) static inline void blocks_avx2(__m256i acc[2], const uint8_t *src, uint8_t *dst,
                                                                size_t nb_blocks, int stream) {
    for (size_t n = 0; n < nb_blocks; n++) {
        const uint8_t *in = src + n * BLOCK_LEN;
        uint8_t *out = dst ? dst + n * BLOCK_LEN : NULL;
        for (size_t s = 0; s < STRIPES_PER_BLOCK; s++) {
            _mm_prefetch((const char *)(in + s * STRIPE_LEN + PREFETCH_BYTES), _MM_HINT_T0);
            accumulate_512_avx2(acc, in + s * STRIPE_LEN, out ? out + s * STRIPE_LEN : NULL, kSecret + s * 8, stream);
        }
        scramble_avx2(acc, kSecret + SECRET_SIZE - STRIPE_LEN);
    }
}

/* ``stream``: non-temporal stores (a copy larger than the cache, whose bytes nobody reads
 * right after), taken where dst is 32-byte aligned (16-byte non-temporal stores measured
 * slower than plain ones here). */
__attribute__((target("avx2"))) static uint64_t hash_long_avx2(const uint8_t *src, uint8_t *dst, size_t len, int stream) {
    uint64_t init[8];
    init_accs(init);
    __m256i acc[2] = {_mm256_loadu_si256((const __m256i *)init), _mm256_loadu_si256((const __m256i *)(init + 4))};
    size_t nb_blocks = (len - 1) / BLOCK_LEN;
    stream = stream && dst != NULL && ((uintptr_t)dst & 31) == 0;
    if (dst == NULL) {
        blocks_avx2(acc, src, NULL, nb_blocks, 0);
    } else if (stream) {
        blocks_avx2(acc, src, dst, nb_blocks, 1);
    } else {
        blocks_avx2(acc, src, dst, nb_blocks, 0);
    }
    size_t done = nb_blocks * BLOCK_LEN;
    size_t nb_stripes = ((len - 1) - done) / STRIPE_LEN;
    for (size_t s = 0; s < nb_stripes; s++) {
        accumulate_512_avx2(acc, src + done + s * STRIPE_LEN, dst ? dst + done + s * STRIPE_LEN : NULL, kSecret + s * 8, 0);
    }
    done += nb_stripes * STRIPE_LEN;
    if (dst != NULL && done < len) {
        memcpy(dst + done, src + done, len - done);
    }
    if (stream) {
        _mm_sfence(); /* the streamed stores land before the last stripe is read back from dst */
    }
    const uint8_t *tail = (dst ? dst : src) + len - STRIPE_LEN;
    accumulate_512_avx2(acc, tail, NULL, kSecret + SECRET_SIZE - STRIPE_LEN - SECRET_LASTACC_START, 0);
    uint64_t out[8];
    _mm256_storeu_si256((__m256i *)out, acc[0]);
    _mm256_storeu_si256((__m256i *)(out + 4), acc[1]);
    return merge_accs(out, (uint64_t)len);
}
#endif

typedef uint64_t (*hash_long_fn)(const uint8_t *, uint8_t *, size_t, int);
static hash_long_fn hash_long = hash_long_scalar;
static const char *kernel_name = "scalar";

/* ---- a digest fed while its bytes arrive ------------------------------------------------ */

/* XXH3 over an input whose length is known up front but whose bytes land piece by piece (a
 * socket): each 1,024-byte block is folded in as soon as it is whole and while it is still in
 * the cache; the last partial block and the last stripe at the end, as in hash_long. */
typedef void (*fold_fn)(uint64_t acc[8], const uint8_t *src, size_t nb_blocks);

typedef struct {
    uint64_t acc[8];
    fold_fn fold;     /* fold_scalar or the CPU's kernel */
    size_t len;       /* the whole input (> MIDSIZE_MAX) */
    size_t nb_blocks; /* (len - 1) / BLOCK_LEN: the blocks folded before the tail */
    size_t folded;    /* of those, folded so far */
} feed_t;

static void fold_scalar(uint64_t acc[8], const uint8_t *src, size_t nb_blocks) {
    blocks_scalar(acc, src, NULL, nb_blocks);
}

#if KV_X86
__attribute__((target("avx2"))) static void fold_avx2(uint64_t acc8[8], const uint8_t *src, size_t nb_blocks) {
    __m256i acc[2] = {_mm256_loadu_si256((const __m256i *)acc8), _mm256_loadu_si256((const __m256i *)(acc8 + 4))};
    blocks_avx2(acc, src, NULL, nb_blocks, 0);
    _mm256_storeu_si256((__m256i *)acc8, acc[0]);
    _mm256_storeu_si256((__m256i *)(acc8 + 4), acc[1]);
}
#endif

static fold_fn fold = fold_scalar;

static void feed_init(feed_t *f, fold_fn kernel, size_t len) {
    init_accs(f->acc);
    f->fold = kernel;
    f->len = len;
    f->nb_blocks = (len - 1) / BLOCK_LEN;
    f->folded = 0;
}

/* The first ``have`` bytes of the input (at ``base``) have landed. */
static void feed_more(feed_t *f, const uint8_t *base, size_t have) {
    size_t whole = have / BLOCK_LEN;
    if (whole > f->nb_blocks) {
        whole = f->nb_blocks;
    }
    if (whole > f->folded) {
        f->fold(f->acc, base + f->folded * BLOCK_LEN, whole - f->folded);
        f->folded = whole;
    }
}

/* All of it has landed: the tail (under 1,088 bytes, scalar: ``tail_scalar``) and the digest. */
static uint64_t feed_finish(feed_t *f, const uint8_t *base) {
    feed_more(f, base, f->len);
    return tail_scalar(f->acc, base, NULL, f->len);
}

/* ---- Python bindings ------------------------------------------------------------------ */

/* Hash (and copy) each of the len / block_bytes blocks; fills digests. GIL released. */
static void run_blocks(hash_long_fn kernel, const uint8_t *src, uint8_t *dst, size_t block_bytes, size_t count,
                       int stream, uint64_t *digests) {
    for (size_t k = 0; k < count; k++) {
        digests[k] = kernel(src + k * block_bytes, dst ? dst + k * block_bytes : NULL, block_bytes, stream);
    }
}

static PyObject *digests_result(const uint64_t *digests, size_t count) {
    PyObject *list = PyList_New((Py_ssize_t)count);
    if (list == NULL) {
        return NULL;
    }
    for (size_t k = 0; k < count; k++) {
        PyObject *item = PyLong_FromUnsignedLongLong(digests[k]);
        if (item == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)k, item);
    }
    return list;
}

/* Checks shared by both calls: block_bytes > MIDSIZE_MAX and len a whole number of blocks. */
static int check_blocks(Py_ssize_t len, Py_ssize_t block_bytes, size_t *count) {
    if (block_bytes <= MIDSIZE_MAX) {
        PyErr_Format(PyExc_ValueError, "block_bytes must be more than %d (got %zd): hash short blocks with xxhash",
                     MIDSIZE_MAX, block_bytes);
        return -1;
    }
    if (len % block_bytes != 0) {
        PyErr_Format(PyExc_ValueError, "buffer of %zd bytes is not a whole number of %zd-byte blocks", len, block_bytes);
        return -1;
    }
    *count = (size_t)(len / block_bytes);
    return 0;
}

#define STACK_DIGESTS 64

static PyObject *finish(int scalar, int stream, const uint8_t *src, uint8_t *dst, size_t block_bytes, size_t count) {
    hash_long_fn kernel = scalar ? hash_long_scalar : hash_long;
    uint64_t stack[STACK_DIGESTS];
    uint64_t *digests = count <= STACK_DIGESTS ? stack : PyMem_RawMalloc(count * sizeof(uint64_t));
    if (digests == NULL) {
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    run_blocks(kernel, src, dst, block_bytes, count, stream, digests);
    Py_END_ALLOW_THREADS
    PyObject *result = digests_result(digests, count);
    if (digests != stack) {
        PyMem_RawFree(digests);
    }
    return result;
}

PyDoc_STRVAR(copy_blocks_doc,
             "copy_blocks(dst, src, block_bytes, scalar=False, stream=False) -> list[int]\n\n"
             "Copy src into dst (same length, a whole number of block_bytes-byte blocks, block_bytes > 240)\n"
             "and return the xxh3-64 of each block, computed from the same loads as the copy.\n"
             "scalar=True takes the portable kernel (tests compare the two); stream=True stores past the\n"
             "cache (a copy larger than it, read by nobody right after; AVX2 with dst 32-byte aligned).");

static PyObject *copy_blocks(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer dst, src;
    Py_ssize_t block_bytes;
    int scalar = 0, stream = 0;
    if (!PyArg_ParseTuple(args, "w*y*n|pp:copy_blocks", &dst, &src, &block_bytes, &scalar, &stream)) {
        return NULL;
    }
    PyObject *result = NULL;
    size_t count;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "dst has %zd bytes, src %zd", dst.len, src.len);
    } else if (check_blocks(src.len, block_bytes, &count) == 0) {
        result = finish(scalar, stream, (const uint8_t *)src.buf, (uint8_t *)dst.buf, (size_t)block_bytes, count);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

PyDoc_STRVAR(hash_blocks_doc,
             "hash_blocks(src, block_bytes, scalar=False) -> list[int]\n\n"
             "The xxh3-64 of each block_bytes-byte block of src (block_bytes > 240), the GIL released.");

static PyObject *hash_blocks(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer src;
    Py_ssize_t block_bytes;
    int scalar = 0;
    if (!PyArg_ParseTuple(args, "y*n|p:hash_blocks", &src, &block_bytes, &scalar)) {
        return NULL;
    }
    PyObject *result = NULL;
    size_t count;
    if (check_blocks(src.len, block_bytes, &count) == 0) {
        result = finish(scalar, 0, (const uint8_t *)src.buf, NULL, (size_t)block_bytes, count);
    }
    PyBuffer_Release(&src);
    return result;
}

/* ---- receive rows from a socket, each hashed as it lands -------------------------------- */

enum { RECV_DONE = 0, RECV_CLOSED = 1, RECV_TIMEOUT = 2, RECV_ERROR = 3, RECV_SIGNAL = 4 };

/* A signal interrupted a wait: run Python's handlers now, as a recv_into would (Ctrl-C stops a
 * read at once, not at its deadline). True when one raised: its exception is set. */
static int signal_raised(void) {
    PyGILState_STATE gil = PyGILState_Ensure();
    int raised = PyErr_CheckSignals() < 0;
    PyGILState_Release(gil);
    return raised;
}

static double monotonic_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Fill each row from the non-blocking stream socket ``fd`` in turn and fold its bytes into its
 * digest as they land. Waits with poll() and SO_RCVLOWAT set to the smaller of ``piece`` and
 * what the row still lacks, so a wake-up finds a piece to receive rather than a few segments
 * (the receive-then-hash of a piece stays in cache); SO_RCVLOWAT is put back to 1 before
 * returning, as the caller's socket expects. Runs without the GIL (taking it only to run
 * Python's signal handlers after an interrupted wait). Returns a RECV_* status; ``*filled``
 * rows are whole, their digests in ``digests``; ``*err`` is errno on RECV_ERROR; on RECV_SIGNAL
 * the handler's exception is set. */
static int recv_rows_fd(int fd, Py_buffer *rows, size_t count, double deadline, size_t piece, fold_fn kernel,
                        uint64_t *digests, size_t *filled, int *err) {
    int status = RECV_DONE;
    int lowat = 1;
    *filled = 0;
    for (size_t k = 0; k < count && status == RECV_DONE; k++) {
        uint8_t *base = (uint8_t *)rows[k].buf;
        size_t len = (size_t)rows[k].len;
        feed_t feed;
        feed_init(&feed, kernel, len);
        size_t got = 0;
        while (got < len) {
            ssize_t n = recv(fd, base + got, len - got, MSG_DONTWAIT);
            if (n > 0) {
                got += (size_t)n;
                feed_more(&feed, base, got);
                continue;
            }
            if (n == 0) {
                status = RECV_CLOSED;
                break;
            }
            if (errno == EINTR) {
                if (signal_raised()) {
                    status = RECV_SIGNAL;
                    break;
                }
                continue;
            }
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                *err = errno;
                status = RECV_ERROR;
                break;
            }
            size_t lack = len - got;
            int want = (int)(lack < piece ? lack : piece);
            if (want != lowat && setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof want) == 0) {
                lowat = want;
            }
            double left = deadline - monotonic_s();
            if (!(left > 0)) {
                status = RECV_TIMEOUT;
                break;
            }
            struct pollfd p = {fd, POLLIN, 0};
            int ready = poll(&p, 1, left > 1.0 ? 1000 : (int)(left * 1000.0) + 1); /* 1 s slices at most */
            if (ready < 0 && errno == EINTR && signal_raised()) {
                status = RECV_SIGNAL;
                break;
            }
            if (ready < 0 && errno != EINTR) {
                *err = errno;
                status = RECV_ERROR;
                break;
            }
        }
        if (status == RECV_DONE) {
            digests[k] = feed_finish(&feed, base);
            *filled = k + 1;
        }
    }
    if (lowat != 1) {
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &one, sizeof one);
    }
    return status;
}

PyDoc_STRVAR(recv_rows_doc,
             "recv_rows(fd, rows, timeout_s, piece_bytes, scalar=False) -> (digests, status, errno)\n\n"
             "Receive each of rows (writable C-contiguous buffers of more than 240 bytes each) whole, in\n"
             "order, from the non-blocking stream socket fd, hashing each as its bytes land (xxh3-64), the\n"
             "GIL released. digests: one per row received whole. status: 0 all rows, 1 the peer closed,\n"
             "2 timeout_s passed, 3 an OS error (errno). piece_bytes: how much to wait for per wake-up.\n"
             "scalar=True takes the portable kernel (tests compare the two).");

static PyObject *recv_rows(PyObject *Py_UNUSED(self), PyObject *args) {
    int fd;
    PyObject *seq;
    double timeout_s;
    Py_ssize_t piece;
    int scalar = 0;
    if (!PyArg_ParseTuple(args, "iOdn|p:recv_rows", &fd, &seq, &timeout_s, &piece, &scalar)) {
        return NULL;
    }
    if (!(timeout_s >= 0)) {
        PyErr_Format(PyExc_ValueError, "timeout_s must be >= 0, got %R", PyTuple_GET_ITEM(args, 2));
        return NULL;
    }
    if (piece < 1 || piece > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "piece_bytes must be in [1, 2**31), got %zd", piece);
        return NULL;
    }
    PyObject *fast = PySequence_Fast(seq, "rows must be a sequence of buffers");
    if (fast == NULL) {
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    Py_buffer *rows = PyMem_Calloc((size_t)(count ? count : 1), sizeof(Py_buffer));
    uint64_t *digests = PyMem_Malloc((size_t)(count ? count : 1) * sizeof(uint64_t));
    PyObject *result = NULL;
    Py_ssize_t held = 0;
    if (rows == NULL || digests == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < count; held++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, held), &rows[held], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            goto done;
        }
        if (rows[held].len <= MIDSIZE_MAX) {
            PyErr_Format(PyExc_ValueError, "row %zd has %zd bytes; recv_rows needs more than %d", held, rows[held].len,
                         MIDSIZE_MAX);
            held++;
            goto done;
        }
    }
    size_t filled = 0;
    int err = 0, status;
    double deadline = monotonic_s() + timeout_s;
    Py_BEGIN_ALLOW_THREADS
    status = recv_rows_fd(fd, rows, (size_t)count, deadline, (size_t)piece, scalar ? fold_scalar : fold, digests,
                          &filled, &err);
    Py_END_ALLOW_THREADS
    if (status == RECV_SIGNAL) { /* a signal handler raised (KeyboardInterrupt): its exception is set */
        goto done;
    }
    PyObject *list = digests_result(digests, filled);
    if (list != NULL) {
        result = Py_BuildValue("(Nii)", list, status, err);
    }
done:
    for (Py_ssize_t k = 0; k < held; k++) {
        PyBuffer_Release(&rows[k]);
    }
    PyMem_Free(rows);
    PyMem_Free(digests);
    Py_DECREF(fast);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_blocks", copy_blocks, METH_VARARGS, copy_blocks_doc},
    {"hash_blocks", hash_blocks, METH_VARARGS, hash_blocks_doc},
    {"recv_rows", recv_rows, METH_VARARGS, recv_rows_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_xxh3copy", "Copy + xxh3-64 in one pass (see the C file's header).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__xxh3copy(void) {
    const uint16_t probe = 1;
    if (*(const uint8_t *)&probe != 1) {
        PyErr_SetString(PyExc_ImportError, "kvpool.core._xxh3copy supports little-endian hosts only");
        return NULL;
    }
#if KV_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
        hash_long = hash_long_avx2;
        fold = fold_avx2;
        kernel_name = "avx2";
    }
#endif
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddStringConstant(m, "KERNEL", kernel_name) < 0 || PyModule_AddIntConstant(m, "MIN_BLOCK_BYTES", MIDSIZE_MAX + 1) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
