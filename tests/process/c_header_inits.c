/* The *_init macros as a C program uses them, through a void pointer too: C converts a
 * `void *` to the option struct's pointer silently, and `sizeof *p` of it would be 1 (GNU C),
 * which the library takes for a struct too small to write. The macros size the struct by its
 * type in the header the program was built with. */
#include <stdlib.h>
#include <string.h>

#include <bubble/bubble.h>

/* 1 when bb_trainer_options_init and bb_task_options_init, given void pointers to fresh
 * memory, wrote the same bytes as the _INIT initialisers. */
int bb_test_c_inits_through_void_pointers(void) {
  const bb_trainer_options_t trainer_defaults = BB_TRAINER_OPTIONS_INIT;
  const bb_task_options_t task_defaults = BB_TASK_OPTIONS_INIT;
  void *t = malloc(sizeof(bb_trainer_options_t));
  void *k = malloc(sizeof(bb_task_options_t));
  int ok = t && k;
  if (ok) {
    memset(t, 0xab, sizeof(bb_trainer_options_t));
    memset(k, 0xab, sizeof(bb_task_options_t));
    bb_trainer_options_init(t);
    bb_task_options_init(k);
    ok = memcmp(t, &trainer_defaults, sizeof trainer_defaults) == 0 &&
         memcmp(k, &task_defaults, sizeof task_defaults) == 0;
  }
  free(t);
  free(k);
  return ok;
}
