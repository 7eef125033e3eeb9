/* The xxh3-64 checksum of a file tier trailer, for _batchio.c's sealed stores: one digest over
 * the payload, then the record's first bytes (exactly what xxhash.xxh3_64(payload) followed by
 * update(record prefix) gives; FrameCodec.encode_trailer is the Python twin, and
 * tests/backends/file/test_sealed_store.py checks that both write the same bytes).
 *
 * The xxHash library (BSD-2-Clause, xxhash/LICENSE) is compiled in inline: this file for the
 * compiler's baseline (SSE2 on x86-64, NEON on arm64), _xxh3_avx2.c for x86-64 processors with
 * AVX2, chosen once when the module loads. */
#include <stddef.h>
#include <stdint.h>

#define XXH_INLINE_ALL
#include "xxhash/xxhash.h"

#include "_xxh3.h"

uint64_t
kvtier_xxh3_pair(const void *first, size_t first_len, const void *second, size_t second_len)
{
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    XXH3_64bits_update(&state, first, first_len);
    XXH3_64bits_update(&state, second, second_len);
    return XXH3_64bits_digest(&state);
}
