/* edgespec's probe gate: llama.cpp asks its eval callback about every tensor of every graph
 * (about a thousand a decode on a 30-layer model). Asked in Python each time, that costs every
 * decode ~0.15 ms on SmolLM2, read or not. The gate answers those questions in C: "not needed"
 * while the engine reads nothing (`on` 0), and while it reads, "needed" only for the tensors it
 * names (`stop`: the final norm "result_norm", where the graph then stops; `names`); the Python
 * probe is called only to copy a needed tensor's data (ask false) and says whether the graph
 * goes on. n < 0: too many names for the gate, every question goes to the probe.
 * runtime/probe_gate.py builds it; without a C compiler the probe answers alone, as before. */
#include <stdbool.h>
#include <string.h>

#define GATE_NAMES 8
#define GATE_NAME_LEN 64

typedef bool (*edgespec_eval_cb)(void *tensor, bool ask, void *user_data);
typedef const char *(*edgespec_name_fn)(const void *tensor);

struct edgespec_gate {
    int on;
    int stop;
    int n;
    edgespec_eval_cb inner;
    edgespec_name_fn get_name;
    char names[GATE_NAMES][GATE_NAME_LEN];
};

bool edgespec_gate_cb(void *tensor, bool ask, void *user_data) {
    struct edgespec_gate *g = (struct edgespec_gate *)user_data;
    if (!g->on)
        return false;
    if (!ask || g->n < 0)
        return g->inner(tensor, ask, 0);
    const char *name = g->get_name(tensor);
    if (g->stop && strcmp(name, "result_norm") == 0)
        return true;
    for (int i = 0; i < g->n; i++)
        if (strcmp(name, g->names[i]) == 0)
            return true;
    return false;
}
