#include <bubble/bubble.h>
#include <stdio.h>
#include <string.h>

/* Opens and closes a hub through the installed library: proves headers, linking and the run-time
 * search path work. BUBBLE_RUNTIME_DIR points at a scratch directory (set by the test). */
int main(void) {
  bb_trainer_h t;
  if (bb_trainer_open("consumer", 0, NULL, &t) != BB_OK) {
    fprintf(stderr, "open: %s\n", bb_last_error());
    return 1;
  }
  if (bb_bubble_begin(t, 1000, BB_MEM_UNKNOWN, BB_BUBBLE_OTHER) != BB_OK || bb_bubble_end(t) != BB_OK)
    return 2;
  bb_trainer_close(t);
  printf("libbubble %s ok\n", bb_version());
  return strcmp(bb_version(), "0.1.0") == 0 ? 0 : 3;
}
