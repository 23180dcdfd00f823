/* The daemon benchmark's workload: says "ready" and waits for a line on stdin (the daemon attaches
   meanwhile), then allocates HELD blocks of 64 bytes and replaces RATE of them a second (a free and
   a malloc each) until killed. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

int main(int argc, char **argv) {
  long held = argc > 1 ? atol(argv[1]) : 100000;
  long rate = argc > 2 ? atol(argv[2]) : 5000;
  printf("ready\n");
  fflush(stdout);
  char go[8];
  if (!fgets(go, sizeof go, stdin)) return 1;
  void **blocks = calloc(held, sizeof *blocks);
  for (long i = 0; i < held; i++) blocks[i] = malloc(64);
  unsigned long next = 1;
  for (;;) {
    /* One millisecond's worth of replacements, then sleep out the rest of it. */
    for (long i = 0; i < rate / 1000; i++) {
      next = next * 6364136223846793005UL + 1442695040888963407UL;
      long slot = (long)((next >> 33) % (unsigned long)held);
      free(blocks[slot]);
      blocks[slot] = malloc(64);
    }
    struct timespec ms = {0, 1000000};
    nanosleep(&ms, NULL);
  }
}
