/* The benchmark loop, shared by churn.c and deep.c: N malloc/free pairs of 16 to 271 bytes in one
   thread; returns the time per pair in ns. */
#include <stdlib.h>
#include <time.h>

__attribute__((noinline, noclone)) static double churn(long n) {
  struct timespec start, end;
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (long i = 0; i < n; i++) {
    char *p = malloc(16 + (i & 255));
    *(volatile char *)p = 1;
    free(p);
  }
  clock_gettime(CLOCK_MONOTONIC, &end);
  return ((end.tv_sec - start.tv_sec) * 1e9 + (end.tv_nsec - start.tv_nsec)) / n;
}
