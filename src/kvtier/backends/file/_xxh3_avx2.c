/* kvtier_xxh3_pair (_xxh3.c) compiled for AVX2 (about 3x the baseline's speed on the test
 * machine: 55 against 19 GB/s). Called only where the processor has AVX2 (checked at load). */
#include <stddef.h>
#include <stdint.h>

#include "_xxh3.h"

#if KVTIER_XXH3_AVX2
#pragma GCC target("avx2")
#define XXH_VECTOR 2 /* XXH_AVX2: the target pragma does not set the macros xxhash.h looks at */
#define XXH_INLINE_ALL
#include "xxhash/xxhash.h"

uint64_t
kvtier_xxh3_pair_avx2(const void *first, size_t first_len, const void *second,
                      size_t second_len)
{
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    XXH3_64bits_update(&state, first, first_len);
    XXH3_64bits_update(&state, second, second_len);
    return XXH3_64bits_digest(&state);
}
#endif
