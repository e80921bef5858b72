/* The page-hash chain of cache_service/chain_hash.py, compiled on first use and linked to the
   libcrypto hashlib loaded (service_shell/native_build.py builds it). */
#include <stdint.h>
#include <string.h>
/* OpenSSL's SHA256_CTX (public in openssl/sha.h since 0.9.8) and its one-block compression,
   which runs the same CPU-specific code (SHA-NI, AVX2...) as every other SHA-256 call. */
typedef struct {
    unsigned int h[8];
    unsigned int Nl, Nh;
    unsigned int data[16];
    unsigned int num, md_len;
} sha256_ctx;
void SHA256_Transform(sha256_ctx *c, const unsigned char *block);

static const unsigned int IV[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

/* out[16*i..] = SHA-256(hash of page i-1 || page i)[:16], page -1 being `parent`. Every
   message is 16 + stride bytes, so its padded blocks are laid out once. */
void prefixcache_chain_hash(const unsigned char *parent, const unsigned char *data, long pages,
                            long stride, unsigned char *out) {
    long len = 16 + stride, blocks = (len + 9 + 63) / 64;
    unsigned char msg[blocks * 64];
    memset(msg, 0, sizeof msg);
    msg[len] = 0x80;
    uint64_t bits = (uint64_t)len * 8;
    for (int k = 0; k < 8; k++)
        msg[blocks * 64 - 1 - k] = (unsigned char)(bits >> (8 * k));
    sha256_ctx ctx;
    const unsigned char *prev = parent;
    for (long i = 0; i < pages; i++) {
        memcpy(msg, prev, 16);
        memcpy(msg + 16, data + i * stride, (size_t)stride);
        memcpy(ctx.h, IV, sizeof IV);
        for (long b = 0; b < blocks; b++)
            SHA256_Transform(&ctx, msg + b * 64);
        unsigned char *hash = out + i * 16;
        for (int k = 0; k < 4; k++) {
            hash[4 * k] = (unsigned char)(ctx.h[k] >> 24);
            hash[4 * k + 1] = (unsigned char)(ctx.h[k] >> 16);
            hash[4 * k + 2] = (unsigned char)(ctx.h[k] >> 8);
            hash[4 * k + 3] = (unsigned char)ctx.h[k];
        }
        prev = hash;
    }
}
