/* The cost of each unwound frame: N malloc/free pairs of 16 to 271 bytes, as bench/churn.c, made
   DEPTH frames above main (DEPTH - 1 frames of `descend`, then `churn`), so that every walk at
   malloc's return and at free's entry goes through DEPTH + the frames below main. Built
   -O2 -fno-omit-frame-pointer: frame pointers and CFI then walk the same frames.
   Usage: deep N DEPTH (DEPTH >= 2). Prints the time per pair. */
#include <stdio.h>

#include "churn_loop.h"

#define FRAME __attribute__((noinline, noclone))
#define KEEP_FRAME() __asm__ volatile("" ::: "memory")

static double ns_per_pair;

/* The asm after the call keeps it a call, not a jump: one frame per level. */
FRAME void descend(int depth, long n) {
  if (depth > 1)
    descend(depth - 1, n);
  else
    ns_per_pair = churn(n);
  KEEP_FRAME();
}

int main(int argc, char **argv) {
  long n = argc > 1 ? atol(argv[1]) : 200000;
  int depth = argc > 2 ? atoi(argv[2]) : 4;
  if (n < 1 || depth < 2) return 2;
  descend(depth - 1, n);
  printf("ns_per_pair %.1f\n", ns_per_pair);
  return 0;
}
