/* quant_avx512.c — AVX-512 (F/BW/VL/VNNI, BF16 where present) kernels. */
#include "quant/quant_impl.h"

void lk_quant_fill_avx512(lk_quant_ops *ops) { ops->name = "avx512"; }
