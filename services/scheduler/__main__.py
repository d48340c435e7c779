from common.service import main
from services.scheduler.server import SchedulerService

if __name__ == "__main__":
    main(SchedulerService, "scheduler")
