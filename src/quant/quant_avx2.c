/* quant_avx2.c — AVX2+FMA+F16C kernels (filled in over the scalar table). */
#include "quant/quant_impl.h"

void lk_quant_fill_avx2(lk_quant_ops *ops) { ops->name = "avx2"; }
