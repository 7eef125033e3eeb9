/* The trailer checksum of the file tier's sealed stores (see _xxh3.c). */
#ifndef KVTIER_XXH3_H
#define KVTIER_XXH3_H

#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__)
#define KVTIER_XXH3_AVX2 1
#else
#define KVTIER_XXH3_AVX2 0
#endif

__attribute__((visibility("hidden"))) uint64_t
kvtier_xxh3_pair(const void *first, size_t first_len, const void *second, size_t second_len);

#if KVTIER_XXH3_AVX2
__attribute__((visibility("hidden"))) uint64_t
kvtier_xxh3_pair_avx2(const void *first, size_t first_len, const void *second,
                      size_t second_len);
#endif

#endif
