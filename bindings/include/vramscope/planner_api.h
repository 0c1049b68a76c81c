/* planner_api.h — vramscope's sweep, max batch, planner and trace as a C library
 * (libvramscope_planner.so), for the Python API (vramscope.estimate, sweep, max_batch, plan)
 * and any other caller: the command's options in, its JSON document out, in this process.
 * The figures are the command's `--format json` ones bit for bit (the same code from the
 * parsed options to the document: tools/command_json.hpp).
 *
 *   const char* argv[] = {"sweep", "--model", "resnet50", "--batch", "64", "--segments", "0"};
 *   char* out = NULL;
 *   int status = vramscope_planner_run(7, argv, &out);   // 0: out is the JSON document
 *   ...
 *   vramscope_planner_free(out);
 */
#ifndef VRAMSCOPE_PLANNER_API_H
#define VRAMSCOPE_PLANNER_API_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define VRAMSCOPE_PLANNER_API_VERSION 3  /* 3: trace */

__attribute__((visibility("default"))) int vramscope_planner_api_version(void);

/* Runs `vramscope ARGV...`: "sweep" (with --max-batch too), "plan" or "trace" (its per-module log,
 * figures, memory plot as SVG text and printed log as the document), and their options. A trace
 * whose step runs out of memory (or that autograd refuses) returns 0: its document holds the log
 * up to the failure and the message as "failure".
 * Returns 0 with *out the JSON document; 2 when the options are refused (the command's exit 2),
 * 1 when the run failed (exit 1): then *out is the one-line message (NULL only when not even
 * that could be allocated). Free *out with vramscope_planner_free. Output options (--format,
 * --brief, --top) are refused: the document is the answer. Runs from several threads take turns. */
__attribute__((visibility("default"))) int vramscope_planner_run(int argc, const char* const* argv, char** out);

/* The same, telling `progress` (when not NULL) as the runs go: the runs done, the runs expected
 * (0 when not known ahead: plan's search), what runs now; on the calling thread, `user` passed on. */
typedef void (*vramscope_planner_progress)(size_t done, size_t total, const char* item, void* user);
__attribute__((visibility("default"))) int vramscope_planner_run_progress(int argc, const char* const* argv,
                                                                          vramscope_planner_progress progress,
                                                                          void* user, char** out);

__attribute__((visibility("default"))) void vramscope_planner_free(char* text);

#ifdef __cplusplus
}
#endif

#endif /* VRAMSCOPE_PLANNER_API_H */
