/* `cargo xtask pause`'s workload: a live heap for `memprof run --inspect` to hold still. Builds a
   list of MIB * 256 blocks of 4 KiB, reachable from a global, each filled with small numbers (no
   pointers but the list's), prints "built" and waits for stdin to close. With WRITES > 0 a second
   thread meanwhile rewrites WRITES blocks a millisecond, one word each, spread over the heap: pages
   written while the inspection's pre-copy runs. */
#include <pthread.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define BLOCK 4096

static void **blocks;
static long count, writes;

static void *writer(void *arg) {
  (void)arg;
  unsigned long next = 1;
  for (;;) {
    for (long i = 0; i < writes; i++) {
      next = next * 6364136223846793005UL + 1442695040888963407UL;
      long *block = blocks[(next >> 33) % (unsigned long)count];
      block[1 + (next >> 20) % (BLOCK / 8 - 1)] = (long)i;
    }
    struct timespec ms = {0, 1000000};
    nanosleep(&ms, NULL);
  }
  return NULL;
}

int main(int argc, char **argv) {
  count = argc > 1 ? atol(argv[1]) * (1 << 20) / BLOCK : 256;
  writes = argc > 2 ? atol(argv[2]) : 0;
  blocks = malloc(count * sizeof *blocks);
  void *head = NULL;
  for (long i = 0; i < count; i++) {
    long *b = malloc(BLOCK);
    for (long w = 1; w < BLOCK / 8; w++) b[w] = i + w;
    b[0] = (long)head;
    head = b;
    blocks[i] = b;
  }
  /* The list is reachable from `head` on main's stack; `blocks` keeps them all reachable too. */
  static void *volatile keep;
  keep = head;
  pthread_t thread;
  if (writes > 0) pthread_create(&thread, NULL, writer, NULL);
  if (write(1, "built\n", 6) != 6) return 1;
  char c;
  while (read(0, &c, 1) == 1) {
  }
  return 0;
}
