// Umbrella header: everything public in dtrain.
#pragma once

#include "dtrain/comm/device.h"
#include "dtrain/comm/env.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/comm/store.h"
#include "dtrain/data/fashion_mnist.h"
#include "dtrain/data/idx.h"
#include "dtrain/data/dataset.h"
#include "dtrain/data/loader.h"
#include "dtrain/data/sampler.h"
#include "dtrain/data/token_file.h"
#include "dtrain/error.h"
#include "dtrain/log.h"
#include "dtrain/parallel/ddp.h"
#include "dtrain/parallel/join.h"
#include "dtrain/trainer/progress.h"
